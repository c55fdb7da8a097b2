"""KV transfers of a prefill/decode handoff (kv_handoff.py): copy some blocks of one engine's KV
cache into blocks of another's, every layer's keys and values, block table to block table
(each block copied once, straight into its place; consecutive blocks in one piece).

`InProcessTransfer` serves engines in one process (the disaggregated replica of
rollout/disaggregated.py), on one device or across devices. Transfers between processes
(a shared-memory cache, Mooncake's transfer engine) take the same call.
"""

from __future__ import annotations

from typing import Any


def block_runs(source: list[int], target: list[int]) -> list[tuple[int, int, int]]:
    """(source start, target start, count) of the runs where both block lists go up by one
    together: a run is copied in one piece."""
    runs: list[tuple[int, int, int]] = []
    for src, dst in zip(source, target):
        if runs and runs[-1][0] + runs[-1][2] == src and runs[-1][1] + runs[-1][2] == dst:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((src, dst, 1))
    return runs


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
        runs = block_runs(source_blocks, target_blocks)
        for caches in ((source.key_caches, target.key_caches),
                       (source.value_caches, target.value_caches)):
            for held, into in zip(*caches):  # [kv heads, blocks, block size, head dim]
                for start, to, count in runs:  # one strided copy per run, into its place
                    part = held.narrow(1, start, count)
                    into.narrow(1, to, count).copy_(part)
                    moved += part.numel() * part.element_size()
        self.blocks_moved += len(source_blocks)
        self.bytes_moved += moved
        return moved
