"""The `native` rollout backend: BaseRollout over tandem's own engine (rollout/engine/)."""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

import torch

from tandem.config.schema import RolloutConfig
from tandem.rollout.adapter_stream import is_adapter_name
from tandem.rollout.base import CAPABILITIES, MEMORY_TAGS, BaseRollout, check_tags
from tandem.rollout.engine import AsyncEngine
from tandem.types import GenerateRequest, TokenOutput


class NativeRollout(BaseRollout):
    """Continuous batching, paged KV cache, prefix cache, per-token logprobs; CPU or CUDA."""

    capabilities = {**{name: "yes" for name in CAPABILITIES}, "multi_modal_inputs": "no",
                    "adapters": "no"}

    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine

    @classmethod
    def create(cls, model_path: str | Path, config: RolloutConfig | None = None,
               dtype: str = "float32", device: str = "cpu") -> "NativeRollout":
        from tandem.models import resolve_model_path

        return cls(AsyncEngine(resolve_model_path(str(model_path)), config or RolloutConfig(),
                               dtype, device))

    async def generate(self, request: GenerateRequest) -> TokenOutput:
        return await self.engine.generate(request)

    async def abort(self, request_id: str) -> None:
        await self.engine.abort(request_id)

    async def abort_all(self) -> None:
        await self.engine.abort_all()

    async def sleep(self, tags: Iterable[str] = MEMORY_TAGS) -> None:
        await self.engine.sleep(check_tags(tags))

    async def wake_up(self, tags: Iterable[str] = MEMORY_TAGS) -> None:
        await self.engine.wake_up(check_tags(tags))

    async def clear_kv_cache(self) -> None:
        await self.engine.clear_kv_cache()

    async def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]],
                             version: int, partial: bool = False) -> None:
        await self.engine.update_weights(named_tensors, version, partial)

    def stage_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]
                      ) -> dict[str, torch.Tensor]:
        """Checked host copies of the stream (AsyncEngine.stage_weights); may run off the
        event loop (commit_weights re-checks that the weights were not put to sleep meanwhile)."""
        return self.engine.stage_weights(named_tensors)

    async def commit_weights(self, staged, version: int, partial: bool = False) -> float:
        """Swap in (or flip to) what was staged; returns the seconds generation stood still."""
        return await self.engine.commit_weights(staged, version, partial)

    def weight_slot_specs(self):
        return self.engine.weight_slot_specs()

    async def map_weight_slots(self, views: list[dict[str, torch.Tensor]], active: int) -> None:
        await self.engine.map_weight_slots(views, active)

    @property
    def weight_slot_active(self) -> int | None:
        return self.engine.weight_slot_active

    def stage_slot_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], index: int):
        return self.engine.stage_slot_weights(named_tensors, index)

    def current_weight(self, name: str) -> torch.Tensor:
        return self.engine.current_weight(name)

    def current_values(self, name: str, index: torch.Tensor) -> torch.Tensor:
        return self.engine.current_values(name, index)

    def patches_in_place(self, name: str) -> bool:
        """Model weights (dense ones in place at commit, packed linears re-packed at staging);
        an adapter's tensors come as full copies (they are merged, not served)."""
        return not is_adapter_name(name)

    @property
    def weight_version(self) -> int:
        return self.engine.version

    def memory_bytes(self) -> dict[str, int]:
        return self.engine.memory_bytes()

    def stats(self) -> dict[str, int]:
        """Engine counters: steps, prompt tokens computed / served from the prefix cache, ..."""
        return self.engine.stats()

    async def shutdown(self) -> None:
        await self.engine.shutdown()
