"""Packing a (name, tensor) stream into fixed-size byte buckets and unpacking it again.

A bucket is a flat uint8 buffer plus a list of `Chunk` records (picklable metadata). A tensor
that does not fit in the room left in a bucket starts the next one; only a tensor larger than a
whole bucket is split across buckets, and the receiver re-joins it in a scratch buffer that
lives on for the next syncs (a fresh allocation would cost a page fault and zeroing per 4 KiB,
more than the copy itself).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Iterator

import torch

from tandem.weight_sync.base import NamedTensors

ALIGN = 64  # chunk offsets inside a bucket are multiples of this, so views of any dtype are legal


@dataclass(frozen=True)
class Chunk:
    """One piece of one tensor inside one bucket."""

    name: str
    shape: tuple[int, ...]
    dtype: str  # e.g. "float32"
    nbytes: int  # of the whole tensor
    tensor_offset: int  # where this piece starts inside the tensor's bytes
    bucket_offset: int  # where it lies inside the bucket
    length: int  # bytes

    @property
    def whole(self) -> bool:
        return self.length == self.nbytes


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_of(name: str) -> torch.dtype:
    return getattr(torch, name)


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of the tensor's bytes (a copy only if it was not contiguous)."""
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8)


def plan_buckets(named_tensors: NamedTensors, bucket_bytes: int
                 ) -> Iterator[list[tuple[Chunk, torch.Tensor]]]:
    """Yield buckets as lists of (chunk, source bytes); pulls one tensor at a time from the stream.
    A tensor that fits in a bucket is never split: it starts a new bucket if this one is short."""
    if bucket_bytes < ALIGN:
        raise ValueError(f"bucket_bytes must be >= {ALIGN}, got {bucket_bytes}")
    bucket: list[tuple[Chunk, torch.Tensor]] = []
    used = 0
    for name, tensor in named_tensors:
        source = as_bytes(tensor)
        shape, dtype, nbytes = tuple(tensor.shape), dtype_name(tensor.dtype), source.numel()
        done = 0
        if used and used + nbytes > bucket_bytes and nbytes <= bucket_bytes:
            yield bucket
            bucket, used = [], 0
        while True:
            if used >= bucket_bytes:
                yield bucket
                bucket, used = [], 0
            length = min(nbytes - done, bucket_bytes - used)
            bucket.append((Chunk(name, shape, dtype, nbytes, done, used, length),
                           source[done:done + length]))
            used += -(-length // ALIGN) * ALIGN
            done += length
            if done == nbytes:
                break
    if bucket:
        yield bucket


def bucket_size(chunks: list[Chunk]) -> int:
    """Bytes a bucket actually uses (its last chunk's end)."""
    return max((c.bucket_offset + c.length for c in chunks), default=0)


def fill_bucket(buffer: torch.Tensor, bucket: list[tuple[Chunk, torch.Tensor]]) -> list[Chunk]:
    """Copy each piece into the uint8 buffer; returns the metadata to send ahead of it."""
    for chunk, source in bucket:
        buffer[chunk.bucket_offset:chunk.bucket_offset + chunk.length].copy_(source)
    return [chunk for chunk, _ in bucket]


_POOL: list[torch.Tensor] = []  # scratch buffers for re-joining split tensors, kept across syncs
_POOL_LOCK = threading.Lock()


class Unpacker:
    """Turns received buckets back into whole tensors, each valid until the next one is asked
    for: whole-in-one-bucket tensors are views of the bucket buffer, split ones are re-joined in
    a scratch buffer (one at a time: a split tensor fills its buckets) borrowed from a pool that
    outlives the sync; `close()` gives it back."""

    def __init__(self) -> None:
        self._partial: dict[str, torch.Tensor] = {}
        self._received: dict[str, int] = {}
        self._scratch: torch.Tensor | None = None

    def _borrow(self, nbytes: int, device: torch.device) -> torch.Tensor:
        if self._scratch is None or self._scratch.numel() < nbytes or self._scratch.device != device:
            self.close()
            with _POOL_LOCK:
                fits = [i for i, b in enumerate(_POOL) if b.device == device and b.numel() >= nbytes]
                if fits:  # by position: list.remove would compare tensors element by element
                    self._scratch = _POOL.pop(fits[0])
            if self._scratch is None:
                self._scratch = torch.empty(nbytes, dtype=torch.uint8, device=device)
        return self._scratch[:nbytes]

    def close(self) -> None:
        """Return the scratch buffer to the pool (the last re-joined tensor is then invalid)."""
        if self._scratch is not None:
            with _POOL_LOCK:
                _POOL.append(self._scratch)
            self._scratch = None

    def unpack(self, buffer: torch.Tensor, chunks: list[Chunk]) -> Iterator[tuple[str, torch.Tensor]]:
        for chunk in chunks:
            piece = buffer[chunk.bucket_offset:chunk.bucket_offset + chunk.length]
            if chunk.whole:
                yield chunk.name, piece.view(dtype_of(chunk.dtype)).view(chunk.shape)
                continue
            if chunk.name not in self._partial:
                self._partial[chunk.name] = self._borrow(chunk.nbytes, buffer.device)
                self._received[chunk.name] = 0
            self._partial[chunk.name][chunk.tensor_offset:chunk.tensor_offset + chunk.length] \
                .copy_(piece)
            self._received[chunk.name] += chunk.length
            if self._received[chunk.name] == chunk.nbytes:
                whole = self._partial.pop(chunk.name)
                del self._received[chunk.name]
                yield chunk.name, whole.view(dtype_of(chunk.dtype)).view(chunk.shape)

    def check_complete(self) -> list[str]:
        """Names of tensors whose pieces did not all arrive."""
        return sorted(self._partial)
