"""The contract every rollout backend implements (native, vllm, sglang).

One class per backend, registered by name in `tandem.rollout.registry`. A server hosts exactly
one instance; the trainer controls it through the same object (hybrid) or through the server.
All methods are async: a backend may run its engine loop in the background.
"""

from __future__ import annotations

import operator
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any, ClassVar, Iterable, Mapping

import torch

from tandem.config.schema import RolloutConfig
from tandem.types import GenerateRequest, TokenOutput

MEMORY_TAGS = ("weights", "kv_cache")

# What a backend can do, each declared in its `capabilities` (docs/backends.md):
#   "yes"         the engine does it itself
#   "workaround"  tandem does it around an engine gap (docs/backends.md says how)
#   "gpu"         "yes" on CUDA; "no" on CPU
#   "no"          not available; the method keeps the documented fallback (see CAPABILITY_FALLBACKS)
CAPABILITIES = ("logprobs_raw", "logprobs_processed", "abort_partial", "per_request_seed",
                "sleep_weights", "sleep_kv_cache", "clear_kv_cache", "update_weights",
                "multi_modal_inputs", "adapters", "kept_sets")
CAPABILITY_LEVELS = ("yes", "workaround", "gpu", "no")
# The behaviour a backend without the capability guarantees instead (checked by tests/conformance).
CAPABILITY_FALLBACKS = {
    "logprobs_raw": "create() raises ValueError naming rollout.logprobs_mode",
    "logprobs_processed": "create() raises ValueError naming rollout.logprobs_mode",
    "abort_partial": "abort() returns no tokens",
    "per_request_seed": "generate() raises ValueError naming the seed field",
    "sleep_weights": "sleep(['weights']) keeps the weights in memory; generation keeps working",
    "sleep_kv_cache": "sleep(['kv_cache']) keeps the KV cache in memory; generation keeps working",
    "clear_kv_cache": "clear_kv_cache() raises NotImplementedError",
    "update_weights": "update_weights() raises NotImplementedError",
    "multi_modal_inputs": "check_request() raises ValueError naming GenerateRequest.multi_modal_data",
    "adapters": "check_request() raises ValueError naming GenerateRequest.adapter",
    "kept_sets": "check_request() raises ValueError naming sampling return_kept_sets",
}


def check_tags(tags: Iterable[str]) -> list[str]:
    """Validate sleep/wake tags; an unknown tag is an error, not a no-op."""
    tags = list(tags)
    unknown = [tag for tag in tags if tag not in MEMORY_TAGS]
    if unknown:
        raise ValueError(f"unknown memory tags {unknown}; valid tags: {list(MEMORY_TAGS)}")
    return tags


def all_finite(tensor: torch.Tensor) -> bool:
    """No NaN or inf in `tensor`. min and max propagate NaN, so one read pass without the
    [numel] bool tensor of isfinite (which made it ~8x slower on CPU)."""
    return tensor.numel() == 0 or bool(torch.isfinite(torch.stack(torch.aminmax(tensor))).all())


def checked_version(version: Any, current: int) -> int:
    """`version` as an int, refused when it is not an integer or older than `current`."""
    if isinstance(version, bool) or not hasattr(version, "__index__"):
        raise TypeError(f"update_weights: version {version!r} is not an integer; weight versions "
                        "are the trainer's step counts")
    version = operator.index(version)
    if version < current:
        raise ValueError(f"update_weights: version {version} is older than the served version "
                         f"{current}; versions only increase (a stale sync must not overwrite "
                         "newer weights)")
    return version


# the input embedding's HF name: a decoder-only LM's, a vision-language model's language model's
EMBED_NAMES = ("model.embed_tokens.weight", "model.language_model.embed_tokens.weight")


def check_coverage(staged: Mapping[str, Any], shapes: Mapping[str, torch.Size], partial: bool,
                   version: int) -> None:
    """An update must hold a tensor, and every weight of the model unless `partial` (an update
    that knowingly changes some weights only, e.g. an adapter's)."""
    if not staged:
        raise ValueError(f"update_weights: the stream held no tensor; stamping version {version} "
                         "on the old weights would claim an update that never happened")
    missing = sorted(set(shapes) - set(staged))
    if missing and not partial:
        raise ValueError(f"update_weights: the stream holds {len(staged)} of the model's "
                         f"{len(shapes)} weights (missing e.g. {missing[:3]}); send all of them, "
                         "or declare the update partial (update_weights(..., partial=True))")


class ReplicaFailedError(RuntimeError):
    """The engine can no longer serve (a rank of its replica died or fell out of step): callers
    treat its server as dead, and the replica must be started again."""


class BaseRollout(ABC):
    """A token-in/token-out engine plus the memory and weight controls training needs."""

    # capability name -> level (CAPABILITIES, CAPABILITY_LEVELS); every name must be declared
    capabilities: ClassVar[Mapping[str, str]] = {}

    @classmethod
    def supports(cls, capability: str, device: str = "cpu") -> bool:
        """Whether the backend does `capability` itself or by a workaround on `device`."""
        level = cls.capabilities[capability]
        return level in ("yes", "workaround") or (level == "gpu" and device.startswith("cuda"))

    @classmethod
    @abstractmethod
    def create(cls, model_path: str | Path, config: RolloutConfig, dtype: str = "float32",
               device: str = "cpu") -> "BaseRollout":
        """Build the engine for the HF model at model_path with the rollout config."""

    @classmethod
    def check_request(cls, request: GenerateRequest, device: str = "cpu") -> None:
        """Refuse what this backend cannot serve (inputs beyond tokens, a LoRA adapter) with a
        ValueError naming the field, instead of generating as if it were not there."""
        if request.multi_modal_data and not cls.supports("multi_modal_inputs", device):
            raise ValueError(f"request {request.request_id!r}: the {cls.__name__} backend takes no "
                             "GenerateRequest.multi_modal_data; send token ids only")
        if request.adapter is not None and not cls.supports("adapters", device):
            raise ValueError(f"request {request.request_id!r}: the {cls.__name__} backend serves no "
                             f"adapters (GenerateRequest.adapter={request.adapter!r}); leave it None")
        if request.sampling.get("return_kept_sets") and not cls.supports("kept_sets", device):
            raise ValueError(f"request {request.request_id!r}: the {cls.__name__} backend does not "
                             "report the top-k / top-p set each token was sampled from (sampling "
                             "return_kept_sets=true); use the native backend or leave it false")

    @abstractmethod
    async def generate(self, request: GenerateRequest) -> TokenOutput:
        """Sample a continuation; one logprob per token; extra_fields["global_steps"] set."""

    @abstractmethod
    async def abort(self, request_id: str) -> None:
        """Stop one request; its caller receives the tokens so far with stop_reason "aborted"."""

    @abstractmethod
    async def abort_all(self) -> None:
        """Stop every running and waiting request, as abort() does for one."""

    @abstractmethod
    async def sleep(self, tags: Iterable[str] = MEMORY_TAGS) -> None:
        """Release the memory of the tagged parts ("weights", "kv_cache")."""

    @abstractmethod
    async def wake_up(self, tags: Iterable[str] = MEMORY_TAGS) -> None:
        """Restore the tagged parts released by sleep()."""

    @abstractmethod
    async def clear_kv_cache(self) -> None:
        """Drop every cached prefix block; running requests keep their own blocks."""

    @abstractmethod
    async def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]],
                             version: int, partial: bool = False) -> None:
        """Load HF-named tensors, invalidate the prefix cache and stamp `version` (an integer, never
        below the served one) on later tokens; all or nothing. The stream holds every weight unless
        `partial` (an adapter's update; a delta sync is not partial)."""

    def stage_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> Any:
        """Receive and check a whole stream without touching the engine (may run in another
        thread); commit_weights() installs it. Default: copies of the tensors."""
        return [(name, tensor.detach().clone()) for name, tensor in named_tensors]

    async def commit_weights(self, staged: Any, version: int, partial: bool = False) -> None:
        """Install what stage_weights() returned and stamp `version` on later tokens."""
        await self.update_weights(staged, version, partial)

    def synced_in_full(self) -> bool:
        """Whether the engine took a whole weight update since it started or last dropped its
        weights: every weight it serves then came from the actor, so a sync may leave the ones
        that never change out. Default: False (every sync sends everything)."""
        return False

    def weight_slot_specs(self) -> Any:
        """(name, shape, dtype) list and aliases (and, tensor parallel, each entry's region) of
        the weights two shared slots would hold, for the double-buffered handoff; None (the
        default): this engine cannot serve from slots, so a shm sync loads it through the plain
        path (engine/slot_weights.py implements them)."""
        return None

    def current_weight(self, name: str) -> torch.Tensor:
        """The dense weight `name` now served (a delta sync applies its changes to it)."""
        raise NotImplementedError(f"{type(self).__name__} cannot report its weights; use a "
                                  "checkpoint engine that sends full tensors")

    def current_values(self, name: str, index: torch.Tensor) -> torch.Tensor:
        """The served weight `name` at flat positions `index` [k] (a delta sync's check)."""
        return self.current_weight(name).reshape(-1).index_select(0, index)

    def patches_in_place(self, name: str) -> bool:
        """Whether stage_weights takes a `types.WeightPatch` for `name` and commit_weights applies
        it in place; if not (the default), a delta sync hands over a patched full copy."""
        return False

    @property
    @abstractmethod
    def weight_version(self) -> int:
        """The version stamped on tokens generated now."""

    def raise_if_failed(self) -> None:
        """Raise ReplicaFailedError when the engine can no longer serve (never, by default)."""

    @abstractmethod
    def memory_bytes(self) -> dict[str, int]:
        """Bytes held per tag: {"weights": ..., "kv_cache": ...}."""

    async def release_kv_cache(self) -> None:
        """Free only the KV cache (weight-sync critical section); call after abort_all()."""
        await self.sleep(["kv_cache"])

    async def resume_kv_cache(self) -> None:
        """Re-allocate the KV cache freed by release_kv_cache()."""
        await self.wake_up(["kv_cache"])

    async def resume(self, tags: Iterable[str] = MEMORY_TAGS) -> None:
        """The seed's name for wake_up(tags)."""
        await self.wake_up(tags)

    async def release(self) -> None:
        """The seed's name for sleep(all tags)."""
        await self.sleep(MEMORY_TAGS)

    async def shutdown(self) -> None:
        """Stop background work; the object is unusable afterwards."""
