"""KV caches in shared memory, and the copy of a handoff's blocks between the ranks of two engines
(rollout.disaggregation.kv_transfer=shm; kv_transfer.py's ShmTransfer).

Each rank of a prefill/decode replica's engines (rank 0 in the server, ranks 1.. in worker
processes) keeps its KV cache in one file in /dev/shm, every layer's keys then values, and
publishes a `SharedKV` (picklable: path, layout, the KV heads it holds). A decode rank maps the
prefill ranks' files once (`KVMaps`) and copies each of its KV heads' runs of blocks straight from
the prefill rank that holds that head into its own cache: one copy, process to process, and the
two sides' tensor-parallel sizes may differ (the heads are re-split by `head_plan`).
"""

from __future__ import annotations

import os
import tempfile
import weakref
from dataclasses import dataclass

import torch

from tandem.weight_layout import dtype_of, map_file, remove_orphans, shm_room

SHM_DIR = "/dev/shm"


@dataclass(frozen=True)
class SharedKV:
    """Where one rank's KV cache lies: the file, its layer count, each cache tensor's shape
    [kv heads, blocks, block size, head dim], dtype, and the model's KV heads it holds."""

    path: str
    num_layers: int
    shape: tuple[int, int, int, int]
    dtype: str
    heads: tuple[int, ...]

    @property
    def layer_bytes(self) -> int:
        count = self.shape[0] * self.shape[1] * self.shape[2] * self.shape[3]
        return count * torch.empty(0, dtype=dtype_of(self.dtype)).element_size()

    @property
    def nbytes(self) -> int:
        return 2 * self.num_layers * self.layer_bytes


def cache_views(buffer: torch.Tensor, share: SharedKV) -> tuple[list[torch.Tensor],
                                                                 list[torch.Tensor]]:
    """The keys and values of every layer, as views of a mapped cache file."""
    size, dtype = share.layer_bytes, dtype_of(share.dtype)
    views = [buffer[index * size:(index + 1) * size].view(dtype).view(share.shape)
             for index in range(2 * share.num_layers)]
    return views[:share.num_layers], views[share.num_layers:]


class SharedCache:
    """One rank's KV cache in a file of `directory` (unlinked by `close` or collection; the file
    of a SIGKILLed engine is removed by the next one that creates its cache there)."""

    def __init__(self, num_layers: int, shape: tuple[int, int, int, int], dtype: torch.dtype,
                 heads: tuple[int, ...], directory: str = SHM_DIR, ranks: int = 1) -> None:
        """`ranks`: how many ranks' caches of this size must fit (rank 0 checks for all: the
        ranks allocate at once, and a tmpfs write past its size is a SIGBUS)."""
        share = SharedKV("", num_layers, shape, str(dtype).removeprefix("torch."), heads)
        remove_orphans(directory)  # first: a SIGKILLed engine's files are not room taken
        problem = shm_room(share.nbytes * ranks, directory, f"the shared KV cache of {ranks} "
                           "rank(s)")
        if problem:
            raise RuntimeError(f"rollout.disaggregation.kv_transfer=shm: {problem}; lower "
                               "rollout.kv_cache_memory_bytes (or gpu_memory_utilization) or "
                               f"give {directory} more room")
        handle, path = tempfile.mkstemp(prefix=f"tandem-kv-{os.getpid()}-", dir=directory)
        try:
            os.ftruncate(handle, share.nbytes)
        finally:
            os.close(handle)
        self._finalizer = weakref.finalize(self, _unlink, path)
        self.share = SharedKV(path, num_layers, shape, share.dtype, heads)
        # a fresh tmpfs file reads as zeros: masked-out slots never hold NaN
        self.key_caches, self.value_caches = cache_views(map_file(path, share.nbytes), self.share)

    def close(self) -> None:
        """Unlink the file; the mapping lives while its views do (peers keep theirs)."""
        self._finalizer()


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


class MappedKV:
    """Another rank's cache file mapped into this process (its keys and values, read-only use)."""

    def __init__(self, share: SharedKV) -> None:
        self.share = share
        self.key_caches, self.value_caches = cache_views(map_file(share.path, share.nbytes),
                                                         share)


class KVMaps:
    """The source ranks' caches this process has mapped, by file; a file the source no longer
    publishes (it slept and re-allocated) is dropped at the next lookup."""

    def __init__(self) -> None:
        self.maps: dict[str, MappedKV] = {}

    def get(self, shares: list[SharedKV]) -> list[MappedKV]:
        """The mapping of each of `shares` (mapped now if new)."""
        kept = {share.path: self.maps.get(share.path) or MappedKV(share) for share in shares}
        self.maps = kept
        return [kept[share.path] for share in shares]


def head_plan(sources: list[tuple[int, ...]], target: tuple[int, ...]
              ) -> list[tuple[int, int, int]]:
    """(source rank, its local head, the target's local head) for each KV head the target rank
    holds: from the first source rank that holds it. A head no source holds is an error."""
    where = {}
    for rank, heads in enumerate(sources):
        for local, head in enumerate(heads):
            where.setdefault(head, (rank, local))
    plan = []
    for local, head in enumerate(target):
        if head not in where:
            raise ValueError(f"KV transfer: no prefill rank holds KV head {head}")
        plan.append((*where[head], local))
    return plan


def copy_heads(sources: list[MappedKV], plan: list[tuple[int, int, int]],
               key_caches: list[torch.Tensor], value_caches: list[torch.Tensor],
               runs: list[tuple[int, int, int]]) -> int:
    """Copy `runs` (source block, target block, count) of each planned head of every layer from
    the mapped source caches into this rank's caches; returns the bytes moved."""
    for source in sources:
        share = source.share
        if share.num_layers != len(key_caches) or share.shape[2:] != key_caches[0].shape[2:] \
                or dtype_of(share.dtype) != key_caches[0].dtype:
            raise ValueError("KV transfer: the engines' caches differ in layers, block size, head "
                             "size or dtype (prefill and decode must serve one model alike)")
    moved = 0
    for kind, targets in ((0, key_caches), (1, value_caches)):
        for layer, into in enumerate(targets):
            for rank, source_head, target_head in plan:
                held = (sources[rank].key_caches, sources[rank].value_caches)[kind][layer]
                for start, to, count in runs:
                    part = held[source_head].narrow(0, start, count)
                    into[target_head].narrow(0, to, count).copy_(part)
                    moved += part.numel() * part.element_size()
    return moved
