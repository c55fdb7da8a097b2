"""Packing a (name, tensor) stream into fixed-size byte buckets and unpacking it again.

A bucket is a flat uint8 buffer plus a list of `Chunk` records (picklable metadata). A tensor
larger than the room left in a bucket is split across buckets and re-joined on the receiver.
"""

from __future__ import annotations

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
    """Yield buckets as lists of (chunk, source bytes); pulls one tensor at a time from the stream."""
    if bucket_bytes < ALIGN:
        raise ValueError(f"bucket_bytes must be >= {ALIGN}, got {bucket_bytes}")
    bucket: list[tuple[Chunk, torch.Tensor]] = []
    used = 0
    for name, tensor in named_tensors:
        source = as_bytes(tensor)
        shape, dtype, nbytes = tuple(tensor.shape), dtype_name(tensor.dtype), source.numel()
        done = 0
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


class Unpacker:
    """Turns received buckets back into whole tensors. Whole-in-one-bucket tensors come out as
    views of the bucket buffer (valid until the buffer is reused); split ones are re-joined into
    a fresh tensor and come out when their last piece arrives."""

    def __init__(self) -> None:
        self._partial: dict[str, torch.Tensor] = {}
        self._received: dict[str, int] = {}

    def unpack(self, buffer: torch.Tensor, chunks: list[Chunk]) -> Iterator[tuple[str, torch.Tensor]]:
        for chunk in chunks:
            piece = buffer[chunk.bucket_offset:chunk.bucket_offset + chunk.length]
            if chunk.whole:
                yield chunk.name, piece.view(dtype_of(chunk.dtype)).view(chunk.shape)
                continue
            if chunk.name not in self._partial:
                self._partial[chunk.name] = torch.empty(chunk.nbytes, dtype=torch.uint8,
                                                        device=buffer.device)
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
