"""Checkpoint engines (weight-sync transports) by name."""

from __future__ import annotations

import importlib

# name -> "module:attribute" of a CheckpointEngine subclass; imported only when asked for.
_CHECKPOINT_ENGINES: dict[str, str] = {
    "naive": "tandem.weight_sync.naive:NaiveCheckpointEngine",
    "gloo": "tandem.weight_sync.collective:GlooCheckpointEngine",
    "nccl": "tandem.weight_sync.nccl:NcclCheckpointEngine",
    "shm": "tandem.weight_sync.shm:ShmCheckpointEngine",
    "delta": "tandem.weight_sync.delta:DeltaCheckpointEngine",
}


# engine_kwargs each built-in engine takes (rollout.checkpoint_engine.engine_kwargs), so a
# misspelt one fails at load time; tests/reliability check the table against the constructors
ENGINE_KWARGS: dict[str, tuple[str, ...]] = {
    "naive": (), "gloo": ("master_addr",), "nccl": ("master_addr",),
    "shm": ("device", "shm_dir", "master_addr", "double_buffer"), "delta": ("transport", "dtype", "max_sparse_ratio")}
DELTA_TRANSPORTS = ("shm", "gloo", "nccl")


def engine_kwargs_problem(name: str, kwargs: dict) -> str | None:
    """Why `kwargs` do not suit checkpoint engine `name` (unknown keys; delta: its inner
    transport's keys count too), or None; engines registered from outside are not checked."""
    if name == "auto":  # resolved at start to naive, shm, gloo or nccl: what they all could take
        accepted = set(ENGINE_KWARGS["gloo"]) & set(ENGINE_KWARGS["shm"])
        unknown = sorted(set(kwargs) - accepted)
        return (f"auto (naive in-process, else shm, gloo or nccl) takes no "
                f"{', '.join(map(repr, unknown))}; its options are {', '.join(sorted(accepted))}; "
                "name a transport to give it more") if unknown else None
    if name not in ENGINE_KWARGS:
        return None
    accepted = set(ENGINE_KWARGS[name])
    if name == "delta":
        transport = kwargs.get("transport", "shm")
        if transport not in DELTA_TRANSPORTS:
            return f"transport={transport!r}: delta rides on one of {', '.join(DELTA_TRANSPORTS)}"
        accepted |= set(ENGINE_KWARGS[transport]) - {"double_buffer"}  # delta patches in place
    unknown = sorted(set(kwargs) - accepted)
    if name == "shm" and kwargs.get("double_buffer") not in (None, True, False):
        return f"double_buffer={kwargs['double_buffer']!r}: true, false, or unset (where memory allows)"
    if name == "shm" and kwargs.get("double_buffer") and kwargs.get("device", "cpu") != "cpu":
        return ("double_buffer maps the engine's weights in /dev/shm slots (CPU engines); with "
                "device cuda set double_buffer false")
    if unknown:
        return (f"{name} takes no {', '.join(map(repr, unknown))}; its options are "
                f"{', '.join(sorted(accepted)) or 'none'}")
    return None


def checkpoint_engine_names() -> tuple[str, ...]:
    """Names accepted by `rollout.checkpoint_engine.backend` (an optional one may not import)."""
    return tuple(_CHECKPOINT_ENGINES)


def register_checkpoint_engine(name: str, target: str) -> None:
    """Register a transport as "module:attribute"."""
    _CHECKPOINT_ENGINES[name] = target


def unavailable_checkpoint_engines() -> dict[str, str]:
    """Registered engines that fail to import here, with the reason."""
    reasons = {}
    for name in _CHECKPOINT_ENGINES:
        try:
            _load(name)
        except ImportError as error:
            reasons[name] = str(error)
    return reasons


def get_checkpoint_engine_class(name: str) -> type:
    """Import and return the checkpoint engine registered under `name`."""
    if name not in _CHECKPOINT_ENGINES:
        missing = unavailable_checkpoint_engines()
        why = "".join(f"; {n} is unavailable here: {reason}" for n, reason in missing.items())
        raise ValueError(f"unknown checkpoint engine {name!r}; registered: "
                         f"{', '.join(_CHECKPOINT_ENGINES)}{why} "
                         "(config field rollout.checkpoint_engine.backend)")
    try:
        return _load(name)
    except ImportError as error:
        usable = [n for n in _CHECKPOINT_ENGINES if n not in unavailable_checkpoint_engines()]
        raise ValueError(f"checkpoint engine {name!r} is unavailable here: {error}; usable: "
                         f"{', '.join(usable)} (config field rollout.checkpoint_engine.backend)") \
            from error


def _load(name: str) -> type:
    module_name, attribute = _CHECKPOINT_ENGINES[name].split(":")
    return getattr(importlib.import_module(module_name), attribute)
