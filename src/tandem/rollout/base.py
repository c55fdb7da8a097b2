"""The contract every rollout backend implements (native, vllm, sglang).

One class per backend, registered by name in `tandem.rollout.registry`. A server hosts exactly
one instance; the trainer controls it through the same object (hybrid) or through the server.
All methods are async: a backend may run its engine loop in the background.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any, Iterable, Mapping

import torch

from tandem.config.schema import RolloutConfig
from tandem.types import TokenOutput

MEMORY_TAGS = ("weights", "kv_cache")


def check_tags(tags: Iterable[str]) -> list[str]:
    """Validate sleep/wake tags; an unknown tag is an error, not a no-op."""
    tags = list(tags)
    unknown = [tag for tag in tags if tag not in MEMORY_TAGS]
    if unknown:
        raise ValueError(f"unknown memory tags {unknown}; valid tags: {list(MEMORY_TAGS)}")
    return tags


class BaseRollout(ABC):
    """A token-in/token-out engine plus the memory and weight controls training needs."""

    @classmethod
    @abstractmethod
    def create(cls, model_path: str | Path, config: RolloutConfig, dtype: str = "float32",
               device: str = "cpu") -> "BaseRollout":
        """Build the engine for the HF model at model_path with the rollout config."""

    @abstractmethod
    async def generate(self, request_id: str, prompt_ids: list[int],
                       sampling_params: Mapping[str, Any]) -> TokenOutput:
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
                             version: int) -> None:
        """Load HF-named tensors, invalidate the prefix cache, stamp `version` on tokens; all or
        nothing: a stream that raises or holds a bad tensor leaves the previous version."""

    def stage_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> Any:
        """Receive and check a whole stream without touching the engine (may run in another
        thread); commit_weights() installs it. Default: copies of the tensors."""
        return [(name, tensor.detach().clone()) for name, tensor in named_tensors]

    async def commit_weights(self, staged: Any, version: int) -> None:
        """Install what stage_weights() returned and stamp `version` on later tokens."""
        await self.update_weights(staged, version)

    def current_weight(self, name: str) -> torch.Tensor:
        """The dense weight `name` now served (a delta sync applies its changes to it)."""
        raise NotImplementedError(f"{type(self).__name__} cannot report its weights; use a "
                                  "checkpoint engine that sends full tensors")

    @property
    @abstractmethod
    def weight_version(self) -> int:
        """The version stamped on tokens generated now."""

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
