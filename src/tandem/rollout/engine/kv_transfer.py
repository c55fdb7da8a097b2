"""KV transfers of a prefill/decode handoff (kv_handoff.py): copy some blocks of one engine's KV
cache into blocks of another's, every layer's keys and values, block table to block table
(each block copied once, straight into its place).

`InProcessTransfer` serves engines in one process (the disaggregated replica of
rollout/disaggregated.py), on one device or across devices. Transfers between processes
(a shared-memory cache, Mooncake's transfer engine) take the same call.
"""

from __future__ import annotations

from typing import Any

import torch


class InProcessTransfer:
    """Copies between the KV caches of two engines of this process; counts blocks and bytes."""

    name = "in_process"

    def __init__(self) -> None:
        self.blocks_moved = 0
        self.bytes_moved = 0

    def copy(self, source: Any, source_blocks: list[int], target: Any,
             target_blocks: list[int]) -> int:
        """Copy blocks `source_blocks` of `source`'s cache (a ModelRunner) into `target_blocks`
        of `target`'s, layer by layer; returns the bytes moved."""
        if len(source_blocks) != len(target_blocks):
            raise ValueError(f"KV transfer: {len(source_blocks)} source blocks for "
                             f"{len(target_blocks)} target blocks")
        if not source_blocks:
            return 0
        if source.block_size != target.block_size or len(source.key_caches) != len(
                target.key_caches):
            raise ValueError("KV transfer: the engines' caches differ in block size or layers "
                             "(prefill and decode must serve one model with one block_size)")
        moved = 0
        for caches in ((source.key_caches, target.key_caches),
                       (source.value_caches, target.value_caches)):
            for held, into in zip(*caches):
                src = torch.tensor(source_blocks, device=held.device)
                dst = torch.tensor(target_blocks, device=into.device)
                part = held.index_select(1, src)  # [kv heads, blocks, block size, head dim]
                into.index_copy_(1, dst, part.to(into.device, into.dtype))
                moved += part.numel() * part.element_size()
        self.blocks_moved += len(source_blocks)
        self.bytes_moved += moved
        return moved
