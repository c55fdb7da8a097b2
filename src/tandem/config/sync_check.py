"""Load-time checks of the weight sync's fields (rollout.checkpoint_engine, rollout.in_flight_kv):
a transport runs on the devices and engines it is named with, and what only the double-buffered
shm handoff into the native CPU engine does is refused elsewhere (docs/weight_sync.md). The
backend's name and its engine_kwargs keys are the registry's: the preflight checks them."""

from __future__ import annotations

from tandem.config.footprint import rollout_devices
from tandem.config.schema import TandemConfig


def sync_problem(config: TandemConfig) -> str | None:
    """The first weight-sync setting that would not run as written, "field: why; fix", or None."""
    return _device_problem(config) or _engine_problem(config) or _in_flight_kv_problem(config)


def _device_problem(config: TandemConfig) -> str | None:
    ckpt = config.rollout.checkpoint_engine
    transport = ckpt.engine_kwargs.get("transport") if ckpt.backend == "delta" else ckpt.backend
    if transport != "nccl" or config.model.device.startswith("cuda"):
        return None
    return (f"rollout.checkpoint_engine.backend: {ckpt.backend!r} moves weights over NCCL, which "
            f"needs CUDA devices, but model.device={config.model.device!r}; use shm or gloo on "
            "CPU (or model.device=cuda)")


def _engine_problem(config: TandemConfig) -> str | None:
    """What only the native engine receives: delta patches and weight slots."""
    rollout = config.rollout
    ckpt = rollout.checkpoint_engine
    if rollout.name != "native" and ckpt.backend == "delta":
        return (f"rollout.checkpoint_engine.backend: is 'delta', but the {rollout.name} backend "
                "cannot report the weights it serves, which delta patches (the first sync would "
                "fail); use auto, shm (one host), gloo or nccl")
    if ckpt.engine_kwargs.get("double_buffer") is not True:
        return None
    if rollout.name != "native":
        return (f"rollout.checkpoint_engine.engine_kwargs.double_buffer: is true, but the "
                f"{rollout.name} backend cannot serve from weight slots (the first sync would "
                "fail); only the native engine on CPU can. Set it false or leave it unset")
    if config.model.device.startswith("cuda"):
        return ("rollout.checkpoint_engine.engine_kwargs.double_buffer: is true, but a CUDA "
                "engine cannot serve from the /dev/shm weight slots (the first sync would fail); "
                "set it false or leave it unset")
    return None


def _in_flight_kv_problem(config: TandemConfig) -> str | None:
    """in_flight_kv=keep acts only at a double-buffered flip: refused where no flip happens."""
    rollout = config.rollout
    if rollout.in_flight_kv != "keep":
        return None
    ckpt = rollout.checkpoint_engine
    if rollout.name != "native":
        why = (f"'keep' is the native engine's; {rollout.name} recomputes running requests after "
               "a weight update")
    elif not rollout_devices(config):
        why = ("in the hybrid layout the engine takes the weights in-process while generation "
               "is paused, so no request runs through an update")
    elif config.model.device.startswith("cuda"):
        why = "a CUDA engine offers no weight slots, so each sync pauses generation"
    elif ckpt.backend not in ("auto", "shm"):
        why = (f"checkpoint engine {ckpt.backend!r} pauses generation for every sync; only the "
               "double-buffered shm handoff updates weights under running requests")
    elif ckpt.engine_kwargs.get("double_buffer") is False:
        why = ("engine_kwargs.double_buffer=false makes shm single-buffered, which pauses "
               "generation for every sync")
    elif config.actor.lora.rank:
        why = ("a LoRA sync sends only the adapter, so shm runs single-buffered and pauses "
               "generation for every sync")
    else:
        return None
    return f"rollout.in_flight_kv: is 'keep', but {why}. Set it to recompute."
