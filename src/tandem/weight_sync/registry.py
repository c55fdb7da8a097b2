"""Checkpoint engines (weight-sync transports) by name."""

from __future__ import annotations

import importlib

# name -> "module:attribute" of a CheckpointEngine subclass; imported only when asked for.
_CHECKPOINT_ENGINES: dict[str, str] = {
    "naive": "tandem.weight_sync.naive:NaiveCheckpointEngine",
}


def checkpoint_engine_names() -> tuple[str, ...]:
    """Names accepted by `rollout.checkpoint_engine.backend`."""
    return tuple(_CHECKPOINT_ENGINES)


def register_checkpoint_engine(name: str, target: str) -> None:
    """Register a transport as "module:attribute"."""
    _CHECKPOINT_ENGINES[name] = target


def get_checkpoint_engine_class(name: str) -> type:
    """Import and return the checkpoint engine registered under `name`."""
    if name not in _CHECKPOINT_ENGINES:
        raise ValueError(f"unknown checkpoint engine {name!r}; registered: "
                         f"{', '.join(_CHECKPOINT_ENGINES)} (config field rollout.checkpoint_engine.backend)")
    module_name, attribute = _CHECKPOINT_ENGINES[name].split(":")
    return getattr(importlib.import_module(module_name), attribute)
