"""Rollout backends by name. The registry, not a YAML comment, says what is supported."""

from __future__ import annotations

import importlib

# name -> "module:attribute" of a BaseRollout subclass; imported only when asked for.
_ROLLOUT_BACKENDS: dict[str, str] = {
    "native": "tandem.rollout.native:NativeRollout",
}


def rollout_backend_names() -> tuple[str, ...]:
    """Names accepted by `rollout.name`."""
    return tuple(_ROLLOUT_BACKENDS)


def register_rollout_backend(name: str, target: str) -> None:
    """Register a backend as "module:attribute"; a later registration of the same name wins."""
    _ROLLOUT_BACKENDS[name] = target


def get_rollout_class(name: str) -> type:
    """Import and return the backend class registered under `name`."""
    if name not in _ROLLOUT_BACKENDS:
        raise ValueError(f"unknown rollout backend {name!r}; registered: "
                         f"{', '.join(_ROLLOUT_BACKENDS)} (config field rollout.name)")
    module_name, attribute = _ROLLOUT_BACKENDS[name].split(":")
    return getattr(importlib.import_module(module_name), attribute)
