"""Two shared-memory weight slots owned by a rollout engine (the double-buffered handoff).

The engine (receiver) lays every weight out once (`SlotLayout`: name -> offset, shape, dtype, at
the rollout dtype) and creates two files of that size in /dev/shm; its dense weights are views of
the active slot. A sender maps the inactive slot (`SlotsDescriptor`, picklable) and writes the
next version into it, tensor by tensor, while the engine keeps generating on the other; the
engine flips only after the whole version arrived and every tensor's checksum matched. Memory
cost: two copies of the weights at the rollout dtype on the engine's host, for as long as the
engine lives; the files of an engine that was SIGKILLed are removed by the next one that creates
its slots in that directory.
"""

from __future__ import annotations

import os
import tempfile
import threading
import weakref
from dataclasses import dataclass
from typing import Iterable, NamedTuple

import torch

from tandem import cpu_kernels
from tandem.weight_layout import (Chunk, WeightSpec, flat_layout, map_file, remove_orphans,
                                  shm_room, view)
from tandem.weight_sync.base import WeightSyncError

CHECKSUM_PIECE_BYTES = 1 << 20  # the torch path sums each piece right after writing it (cache-hot)


class Region(NamedTuple):
    """The part of a sender's full tensor `source` that a slot entry holds: [start, stop) along
    `dim` (a tensor-parallel rank's slice)."""

    source: str
    dim: int
    start: int
    stop: int


@dataclass(frozen=True)
class SlotLayout:
    """Every weight of the engine in slot order; `nbytes` is one slot's size. An entry with a
    region holds that part of the sender's tensor (the slices of every rank of a replica)."""

    entries: tuple[Chunk, ...]  # each whole
    nbytes: int
    aliases: tuple[tuple[str, str], ...] = ()  # (name a sender may use, the entry it fills)
    regions: tuple[tuple[str, Region], ...] = ()  # (entry, the part of the tensor it holds)

    def by_name(self) -> dict[str, Chunk]:
        return {entry.name: entry for entry in self.entries}

    def targets(self) -> dict[str, list[tuple[Chunk, Region | None]]]:
        """Sender's tensor name -> the entries it fills, each with its region (None: whole)."""
        regions = dict(self.regions)
        targets: dict[str, list[tuple[Chunk, Region | None]]] = {}
        for entry in self.entries:
            region = regions.get(entry.name)
            targets.setdefault(region.source if region else entry.name, []).append(
                (entry, region))
        return targets


@dataclass(frozen=True)
class SlotsDescriptor:
    """What a sender needs to write an engine's inactive slot (travels in the sync plan)."""

    paths: tuple[str, str]
    layout: SlotLayout
    active: int  # the slot the engine serves from now; the sender writes 1 - active

    @property
    def inactive(self) -> int:
        return 1 - self.active


def make_layout(weights: Iterable[WeightSpec], aliases: dict[str, str] | None = None,
                regions: dict[str, tuple[str, int, int, int]] | None = None) -> SlotLayout:
    """The weights' flat layout (weight_layout.flat_layout), with the names a sender may use
    and the region (source, dim, start, stop) of every entry that holds part of a tensor."""
    entries, nbytes = flat_layout(weights)
    return SlotLayout(tuple(entries), nbytes, tuple(sorted((aliases or {}).items())),
                      tuple(sorted((name, Region(*region))
                                   for name, region in (regions or {}).items())))


_MAPPED: dict[str, torch.Tensor] = {}  # path -> this process's one mapping of it
_MAPPED_LOCK = threading.Lock()  # the engine and its transports map from several threads


def mapped(path: str, nbytes: int) -> torch.Tensor:
    """This process's mapping of the slot file as a shared uint8 tensor (one per path, so the
    transport and the engine of one process see the same addresses)."""
    with _MAPPED_LOCK:
        current = _MAPPED.get(path)
        if current is None or current.numel() != nbytes:
            try:
                current = map_file(path, nbytes)
            except (RuntimeError, OSError, ValueError) as error:
                raise WeightSyncError("init_process_group", None, f"cannot map weight slot "
                                      f"{path} ({error}); double-buffered shm needs the engine "
                                      "on the sender's host") from error
            _MAPPED[path] = current
        return current


def forget(paths: Iterable[str]) -> None:
    """Drop this process's mappings of `paths` (their engine closed them)."""
    with _MAPPED_LOCK:
        for path in paths:
            _MAPPED.pop(path, None)


def byte_sum(data: torch.Tensor) -> int:
    """A 64-bit wrapping sum of the bytes as little-endian int64 words (the tail zero-padded)."""
    ops = _kernels(data)
    if ops is not None:
        return ops.sum_words(data)
    flat = data.reshape(-1).view(torch.uint8)
    whole = flat.numel() // 8 * 8
    total = int(flat[:whole].view(torch.int64).sum()) if whole else 0
    tail = bytes(flat[whole:].tolist()) + bytes(8 - (flat.numel() - whole))
    total += int.from_bytes(tail, "little", signed=True)
    return (total + 2**63) % 2**64 - 2**63


def write_and_sum(destination: torch.Tensor, source: torch.Tensor) -> int:
    """Copy (and cast) `source` into the slot view `destination`; returns byte_sum(destination).
    Same dtype on CPU: one fused pass (cpu_kernels' copy_and_sum, streaming stores); else torch
    copies piece by piece, summing each piece of the destination while it is still in cache."""
    source = source.detach()
    ops = _kernels(destination, source)
    if ops is not None and source.dtype == destination.dtype:
        return ops.copy_and_sum(destination, source)
    flat_dst = destination.reshape(-1)
    flat_src = source.reshape(-1)
    words = flat_dst.view(torch.uint8)
    size = destination.element_size()
    step = max(1, CHECKSUM_PIECE_BYTES // size)  # a piece is whole 8-byte words but the last
    total, count = 0, flat_dst.numel()
    for start in range(0, count, step):
        end = min(start + step, count)
        flat_dst[start:end].copy_(flat_src[start:end])
        piece = words[start * size:end * size]
        total += int(piece.view(torch.int64).sum()) if piece.numel() % 8 == 0 else byte_sum(piece)
    return (total + 2**63) % 2**64 - 2**63


def _kernels(*tensors: torch.Tensor) -> object | None:
    """The fused CPU ops when every tensor is a contiguous CPU tensor and this machine has built
    them (the native engine builds them when it starts on CPU fp32), else None: a sync never
    waits for a compile."""
    if all(t.device.type == "cpu" and t.is_contiguous() for t in tensors):
        return cpu_kernels.load_built()
    return None


class WeightSlots:
    """The engine's two slot files and their mappings; `close()` (or collection) unlinks them."""

    def __init__(self, layout: SlotLayout, shm_dir: str = "/dev/shm") -> None:
        self.layout = layout
        self.paths: list[str] = []
        self.slots: list[torch.Tensor] = []
        remove_orphans(shm_dir)  # slots (and buffers) of engines that were SIGKILLed
        for index in range(2):
            handle, path = tempfile.mkstemp(prefix=f"tandem-slot-{os.getpid()}-{index}-",
                                            dir=shm_dir)
            try:
                os.ftruncate(handle, layout.nbytes)
            finally:
                os.close(handle)
            self.paths.append(path)
        self._finalizer = weakref.finalize(self, _unlink, list(self.paths))
        self.slots = [mapped(path, layout.nbytes) for path in self.paths]

    def views(self, index: int) -> dict[str, torch.Tensor]:
        """Every weight of slot `index` as a view."""
        return {entry.name: view(self.slots[index], entry) for entry in self.layout.entries}

    def descriptor(self, active: int) -> SlotsDescriptor:
        """What a sender needs, with the slot the engine serves from now."""
        return SlotsDescriptor((self.paths[0], self.paths[1]), self.layout, active)

    def close(self) -> None:
        """Unlink the files; views stay valid while referenced (the pages go with the last)."""
        self._finalizer()
        forget(self.paths)
        self.slots = []


def slots_fit(nbytes: int, shm_dir: str = "/dev/shm") -> str | None:
    """Why two slots of `nbytes` do not fit (free space of shm_dir, available memory), or None."""
    return shm_room(2 * nbytes, shm_dir, "two weight slots")


def _unlink(paths: list[str]) -> None:
    for path in paths:
        if os.path.exists(path):
            os.unlink(path)
