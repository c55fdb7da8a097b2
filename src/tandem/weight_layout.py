"""Where weights lie in flat byte buffers, each at a multiple of 64 bytes.

One planner: `plan_buckets` lays (name, shape, dtype) out back to back in buckets of a fixed
size (the transports' buffers, the external engines' update calls) or, with no size, in one
buffer for a whole model (`flat_layout`: the weight slots, the vLLM adapter's segment). And
`map_file`: one such buffer's file mapped shared; `shm_room`: whether such buffers fit in the shared-memory directory that holds their files, and
`remove_orphans`: the files a SIGKILLed process left there.
"""

from __future__ import annotations

import glob
import mmap
import os
import shutil
import sys
from typing import Iterable, Iterator, NamedTuple, Sequence

import torch

ALIGN = 64  # every piece starts on a cache line, so a view of any dtype is legal
MADV_POPULATE_WRITE = 23  # Linux's value; Python's mmap module names it from 3.12 on

WeightSpec = tuple[str, Sequence[int], torch.dtype]  # (name, shape, dtype)


class Chunk(NamedTuple):
    """One weight, or a piece of one larger than a bucket, inside a flat uint8 buffer (a tuple:
    it crosses pickle and msgpack as plain data)."""

    name: str
    shape: tuple[int, ...]
    dtype: str  # e.g. "float32"
    nbytes: int  # of the whole weight
    tensor_offset: int  # where this piece starts inside the weight's bytes
    offset: int  # where it lies inside the buffer
    length: int  # bytes

    @property
    def whole(self) -> bool:
        return self.length == self.nbytes


def dtype_of(name: str) -> torch.dtype:
    return getattr(torch, name)


def aligned(nbytes: int) -> int:
    """nbytes rounded up to a multiple of ALIGN."""
    return -(-nbytes // ALIGN) * ALIGN


def plan_buckets(weights: Iterable[WeightSpec], bucket_bytes: int | None = None
                 ) -> Iterator[list[Chunk]]:
    """Yield buckets of chunks, pulling one weight at a time; None: one bucket of any size. A
    weight that fits in a bucket is never split: it starts a new bucket if this one is short."""
    if bucket_bytes is not None and bucket_bytes < ALIGN:
        raise ValueError(f"bucket_bytes must be >= {ALIGN}, got {bucket_bytes}")
    room = sys.maxsize if bucket_bytes is None else bucket_bytes
    bucket: list[Chunk] = []
    used = 0
    for name, shape, dtype in weights:
        shape, dtype_name = tuple(shape), str(dtype).removeprefix("torch.")
        nbytes, done = torch.Size(shape).numel() * dtype.itemsize, 0
        if used and used + nbytes > room >= nbytes:
            yield bucket
            bucket, used = [], 0
        while True:
            if used >= room:
                yield bucket
                bucket, used = [], 0
            length = min(nbytes - done, room - used)
            bucket.append(Chunk(name, shape, dtype_name, nbytes, done, used, length))
            used += aligned(length)
            done += length
            if done == nbytes:
                break
    if bucket:
        yield bucket


def bucket_size(chunks: Sequence[Chunk]) -> int:
    """Bytes a bucket actually uses (its last chunk's end)."""
    return max((c.offset + c.length for c in chunks), default=0)


def flat_layout(weights: Iterable[WeightSpec]) -> tuple[list[Chunk], int]:
    """Every weight whole in one buffer: its chunks, and the buffer's size (a multiple of ALIGN,
    at least ALIGN: a file of 0 bytes cannot be mapped)."""
    chunks = next(plan_buckets(weights), [])
    return chunks, max(aligned(bucket_size(chunks)), ALIGN)


def view(buffer: torch.Tensor, chunk: Chunk) -> torch.Tensor:
    """A whole chunk inside a flat uint8 buffer, as its dtype and shape (no copy)."""
    piece = buffer[chunk.offset:chunk.offset + chunk.length]
    return piece.view(dtype_of(chunk.dtype)).view(chunk.shape)


def map_file(path: str, nbytes: int) -> torch.Tensor:
    """mmap a file shared, as a uint8 tensor, and fault every page in now: the first write
    through a fresh mapping otherwise takes a page fault per 4 KiB (measured: a 500 MB write
    2.5x slower)."""
    with open(path, "r+b") as handle:
        mapping = mmap.mmap(handle.fileno(), nbytes, mmap.MAP_SHARED)
    try:
        mapping.madvise(getattr(mmap, "MADV_POPULATE_WRITE", MADV_POPULATE_WRITE))
    except OSError:  # kernels before 5.14: pages fault in on first use instead
        pass
    return torch.frombuffer(mapping, dtype=torch.uint8)  # keeps `mapping` alive


def shm_room(nbytes: int, directory: str, what: str) -> str | None:
    """Why `nbytes` more bytes of `what` (files in the tmpfs `directory`) do not fit: its free
    space, or the host's available memory (tmpfs pages are memory); None when they do. Check
    before writing: a write past a full tmpfs is a SIGBUS that kills the process, not an error."""
    free = shutil.disk_usage(directory).free
    if free < nbytes:
        return f"{directory} has {free >> 20} MiB free, {what} need {-(-nbytes >> 20)} MiB"
    available = _mem_available()
    if available is not None and available < nbytes:
        return (f"the host has {available >> 20} MiB of memory available, {what} need "
                f"{-(-nbytes >> 20)} MiB")
    return None


def _mem_available() -> int | None:
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) << 10
    except OSError:
        return None
    return None


# tandem's shared-memory files are named tandem-<kind>-<pid of their creator>-...: the shm
# transport's ring (sync), an engine's weight slots (slot), the vLLM adapter's segment (vllm), a
# PD replica's KV caches (kv)
SHM_FILE_KINDS = ("sync", "slot", "vllm", "kv")


def remove_orphans(directory: str) -> list[str]:
    """Unlink tandem's files in `directory` whose creating process no longer exists (killed
    before it could unlink them); returns their paths. Every creator calls it first."""
    removed = []
    for kind in SHM_FILE_KINDS:
        for path in glob.glob(os.path.join(directory, f"tandem-{kind}-*-*")):
            pid = os.path.basename(path).split("-")[2]
            if pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
                try:
                    os.unlink(path)
                    removed.append(path)
                except FileNotFoundError:  # another creator removed it first
                    pass
    return removed
