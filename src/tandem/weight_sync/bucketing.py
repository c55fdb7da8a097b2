"""Packing a (name, tensor) stream into fixed-size byte buckets and unpacking it again.

The buckets are tandem.weight_layout's plan: a flat uint8 buffer plus a list of `Chunk` records
(picklable metadata). Only a tensor larger than a whole bucket is split across buckets, and the
receiver re-joins it in a scratch buffer that lives on for the next syncs (a fresh allocation
would cost a page fault and zeroing per 4 KiB, more than the copy itself).
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Iterator

import torch

from tandem.weight_layout import Chunk, dtype_of, plan_buckets, view
from tandem.weight_sync.base import NamedTensors


def tensor_buckets(named_tensors: NamedTensors, bucket_bytes: int
                   ) -> Iterator[list[tuple[Chunk, torch.Tensor]]]:
    """plan_buckets over a tensor stream: buckets of (chunk, its source bytes); pulls one tensor
    at a time."""
    pulled: deque[torch.Tensor] = deque()  # sources planned but not yet handed out, in order

    def weights():
        for name, tensor in named_tensors:
            # a flat uint8 view of its bytes (a copy only if it was not contiguous)
            pulled.append(tensor.detach().contiguous().reshape(-1).view(torch.uint8))
            yield name, tensor.shape, tensor.dtype

    source = torch.empty(0, dtype=torch.uint8)
    for chunks in plan_buckets(weights(), bucket_bytes):
        bucket = []
        for chunk in chunks:
            if chunk.tensor_offset == 0:  # every weight's first chunk: the next source
                source = pulled.popleft()
            bucket.append((chunk, source[chunk.tensor_offset:chunk.tensor_offset + chunk.length]))
        yield bucket


def fill_bucket(buffer: torch.Tensor, bucket: list[tuple[Chunk, torch.Tensor]]) -> list[Chunk]:
    """Copy each piece into the uint8 buffer; returns the metadata to send ahead of it."""
    for chunk, source in bucket:
        buffer[chunk.offset:chunk.offset + chunk.length].copy_(source)
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
            if chunk.whole:
                yield chunk.name, view(buffer, chunk)
                continue
            piece = buffer[chunk.offset:chunk.offset + chunk.length]
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
