"""What the native engine holds in memory: the KV cache's size, and sleep/wake.

sleep(["kv_cache"]) frees the cache (unfinished requests recompute after wake_up);
sleep(["weights"]) moves the weights to host memory on GPU and drops them on CPU, where a host
copy would be the weights themselves: after wake_up the next full update_weights refills them.
`MemoryControl` is that part of AsyncEngine's API (the engine mixes it in).
"""

from __future__ import annotations

from typing import Any, Iterable

import torch

from tandem.config.schema import RolloutConfig
from tandem.rollout.base import MEMORY_TAGS, check_tags
from tandem.rollout.engine.lora_merge import LoraState


def plan_num_blocks(config: RolloutConfig, runner: Any, device: torch.device) -> int:
    """KV blocks from the budget: kv_cache_memory_bytes, except on CUDA when it is 0 or left at
    its default, where gpu_memory_utilization x device memory minus what is allocated; 0 on CPU
    means the default budget. Capped at what max_num_seqs full-context sequences could use."""
    block_bytes = runner.block_bytes(config.block_size)
    budget = config.kv_cache_memory_bytes
    default_budget = RolloutConfig.__dataclass_fields__["kv_cache_memory_bytes"].default
    if device.type == "cuda" and budget in (0, default_budget):
        total = torch.cuda.get_device_properties(device).total_memory
        budget = int(total * config.gpu_memory_utilization) - torch.cuda.memory_allocated(device)
    elif budget == 0:
        budget = default_budget
    useful = config.max_num_seqs * -(-runner.max_model_len // config.block_size)
    num_blocks = min(budget // block_bytes, useful)
    if num_blocks < 1:
        raise ValueError(f"KV cache budget {budget} bytes holds no block of {block_bytes} bytes "
                         "(rollout.kv_cache_memory_bytes / gpu_memory_utilization / block_size)")
    return int(num_blocks)


class MemoryControl:
    """AsyncEngine's sleep/wake, under the step lock (uses the engine's runner, scheduler,
    blocks, lock and weight state)."""

    async def sleep(self, tags: Iterable[str] = MEMORY_TAGS) -> None:
        tags = check_tags(tags)
        self._ensure_loop()
        async with self._lock:
            if "kv_cache" in tags and not self.kv_released:
                self.scheduler.preempt_all()  # unfinished requests recompute after wake_up
                self.runner.free_kv_cache()
                self.kv_shares = None
                self._reset_blocks(0)
                self.kv_released = True
            if "weights" in tags and self.weights_state == "loaded":
                self.scheduler.preempt_all()
                self.blocks.clear_prefix_cache()
                self._release_weights()
            if self.ranks is not None:
                self.ranks.sleep(tags)

    async def wake_up(self, tags: Iterable[str] = MEMORY_TAGS) -> None:
        tags = check_tags(tags)
        self._ensure_loop()
        async with self._lock:
            if "weights" in tags and self.weights_state != "loaded":
                self._restore_weights()
            if "kv_cache" in tags and self.kv_released:
                self.runner.allocate_kv_cache(self.num_blocks, self.block_size)
                self._reset_blocks(self.num_blocks)
                self.kv_released = False
            if self.ranks is not None:
                self.ranks.wake_up(tags)
            if "kv_cache" in tags:
                self.publish_kv()
            self._work.set()

    async def clear_kv_cache(self) -> None:
        self._ensure_loop()
        async with self._lock:
            self.blocks.clear_prefix_cache()

    def memory_bytes(self) -> dict[str, int]:
        """Bytes of weights and KV cache the engine holds on its devices (with tensor
        parallelism: all ranks, the others' as they last reported after a control call)."""
        held = held_bytes(self.runner)
        for rank in (self.ranks.memory if self.ranks is not None else []):
            held = {kind: held[kind] + rank[kind] for kind in held}
        return held

    def _release_weights(self) -> None:
        """GPU: move the weights to CPU memory. CPU: drop them, packed ones included
        (update_weights refills them)."""
        self.weights_state, self.weight_shapes = release_weights(self.runner)
        if self.device.type == "cpu":  # the refill is a full stream, which is the new base
            self.lora = LoraState()
        self._forget_slots()

    def _restore_weights(self) -> None:
        self.unfilled_weights = restore_weights(self.runner, self.weights_state,
                                                self.weight_shapes)
        self.weights_state = "loaded"

    def synced_in_full(self) -> bool:
        """BaseRollout.synced_in_full: a whole update committed, nothing dropped since."""
        return self.whole_update and self.weights_state == "loaded" and not self.unfilled_weights

    def _weights_missing_message(self) -> str:
        if self.weights_state != "loaded":
            return (f"the engine's weights are {self.weights_state} by sleep(['weights']); call "
                    "wake_up(['weights']) first")
        missing = sorted(self.unfilled_weights)
        return (f"the engine's weights were dropped by sleep(['weights']) on CPU and "
                f"{len(missing)} tensors are not refilled yet (e.g. {missing[:3]}); call "
                "update_weights with the full state dict after wake_up(['weights'])")


def held_bytes(runner: Any) -> dict[str, int]:
    """Bytes of weights (packed ones included) and KV cache a runner holds on its device."""
    weights = sum(p.numel() * p.element_size() for p in runner.named_parameters().values()
                  if p.device.type == runner.device.type)
    return {"weights": weights + runner.packed_bytes(), "kv_cache": runner.kv_cache_bytes()}


def release_weights(runner: Any) -> tuple[str, dict[str, torch.Size]]:
    """Free a runner's weights: moved to CPU memory on GPU ("offloaded"), dropped on CPU
    ("dropped", packed ones included). Returns that state and the dense weights' shapes."""
    parameters = runner.named_parameters()
    shapes = {name: p.shape for name, p in parameters.items()}
    on_cpu = runner.device.type == "cpu"
    for param in parameters.values():
        param.data = torch.empty(0, dtype=param.dtype) if on_cpu else param.data.to("cpu")
    runner.release_packed()  # packed weights exist on CPU only
    return ("dropped" if on_cpu else "offloaded"), shapes


def restore_weights(runner: Any, state: str, shapes: dict[str, torch.Size]) -> set[str]:
    """Bring back what release_weights freed: offloaded weights are copied back, dropped ones
    allocated uninitialised. Returns the names a full update_weights must refill (none after an
    offload)."""
    parameters = runner.named_parameters()
    for name, param in parameters.items():
        if state == "offloaded":
            param.data = param.data.to(runner.device)
        else:
            param.data = torch.empty(shapes[name], dtype=param.dtype, device=runner.device)
    if state == "offloaded":
        return set()
    return set(parameters) | set(runner.packed_linears)
