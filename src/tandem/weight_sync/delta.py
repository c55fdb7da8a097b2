"""`delta`: only the elements that changed since the receivers' version travel
(docs/weight_sync.md, "delta").

The sender keeps a copy of what it last synced, at the rollout dtype (`dtype` kwarg; compared
bit for bit), and its version. When every receiver reports that version, each tensor goes as
its changed flat indices + values if that is under `max_sparse_ratio` of its dense bytes, else
dense; otherwise the whole sync is dense. From `encode_ahead` (the compare, before generation
pauses) or a send until that sync succeeds the copy is pending, trusted by no plan. A receiver
checks 64-bit sums (`byte_sum`) of the new values and of its own values at the changed
positions; one that `patches_in_place(name)` gets a `WeightPatch` (O(changes)), any other a
patched copy of `current_weights(name)`, checked whole. The bytes ride on an inner transport.

Wire names: "<name>\\x00dense", or "<name>\\x00index", "<name>\\x00value", "<name>\\x00sum" (int64
[3]: old values at the index, new values, the whole new tensor).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator

import torch

from tandem.types import WeightPatch
from tandem.weight_sync.base import CheckpointEngine, NamedTensors, SyncPlan, WeightSyncError
from tandem.weight_sync.registry import get_checkpoint_engine_class

SEPARATOR = "\x00"
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def byte_sum(tensor: torch.Tensor) -> torch.Tensor:
    """A 0-dim int64: the tensor's bytes as little-endian 64-bit words (the last one zero-padded),
    summed with wraparound."""
    data = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
    whole = data.numel() // 8 * 8
    tail = torch.zeros(8, dtype=torch.uint8, device=data.device)
    tail[:data.numel() - whole] = data[whole:]
    return data[:whole].view(torch.int64).sum() + tail.view(torch.int64)[0]


def changed_indices(new: torch.Tensor, old: torch.Tensor) -> torch.Tensor | None:
    """Flat indices where the bits differ (NaN-safe, -0.0 != 0.0); None if not comparable."""
    bits = _BITS.get(new.element_size())
    if bits is None or new.shape != old.shape or new.dtype != old.dtype:
        return None
    flat_new, flat_old = new.reshape(-1).view(bits), old.reshape(-1).view(bits)
    return torch.ne(flat_new, flat_old).nonzero().reshape(-1)


@dataclass
class _Ahead:
    """What encode_ahead prepared: the wire records of `version`'s sync against `against`."""

    version: int
    against: int | None  # None: every tensor dense, fit for any receiver
    records: list[tuple[str, torch.Tensor]]


class DeltaCheckpointEngine(CheckpointEngine):
    """Sparse updates against the receivers' current weights over an inner transport."""

    name = "delta"
    encodes_ahead = True

    def __init__(self, bucket_megabytes: int = 512, timeout_s: float = 300.0,
                 transport: str = "shm", dtype: str | None = None, max_sparse_ratio: float = 0.5,
                 current_weights: Callable[[str], torch.Tensor] | None = None,
                 current_version: int | None = None,
                 current_values: Callable[[str, torch.Tensor], torch.Tensor] | None = None,
                 patches_in_place: Callable[[str], bool] | None = None,
                 **transport_kwargs) -> None:
        super().__init__(bucket_megabytes, timeout_s)
        if transport == "shm":
            transport_kwargs["double_buffer"] = False
        self.inner = get_checkpoint_engine_class(transport)(bucket_megabytes, timeout_s,
                                                            **transport_kwargs)
        self.dtype = getattr(torch, dtype) if dtype else None
        self.max_sparse_ratio = max_sparse_ratio
        self.current_weights, self.current_version = current_weights, current_version
        self.current_values = current_values or (
            lambda name, index: self.current_weights(name).reshape(-1).index_select(0, index))
        self.patches_in_place = patches_in_place or (lambda name: False)
        self._base: dict[str, torch.Tensor] = {}  # sender: what the receivers hold ...
        self._base_version: int | None = None  # ... and its version (None: nothing trusted)
        self._ahead: _Ahead | None = None
        self.bytes_sent = 0
        self.sparse_tensors = 0  # sent as index + value in the last sync

    def encode_ahead(self, named_tensors: NamedTensors, version: int) -> None:
        """Encode `version` against the kept copy now, before generation pauses; the copy holds
        `version` from here on but is trusted only once that sync succeeds."""
        self._ahead, against = None, self._base_version
        if against is None:
            self._base = {}  # nothing to compare with: free the old copy before the new one
        self._base_version = None
        self.sparse_tensors = 0
        self._ahead = _Ahead(version, against, list(self._encode(named_tensors)))

    def build_topology(self, n_receivers: int, version: int,
                       receiver_versions: list[int] | None = None,
                       receiver_slots: list | None = None) -> SyncPlan:
        """Delta if every receiver holds the version of the sender's copy, else full; the
        encoding prepared ahead is used if it is for `version` and fits the receivers."""
        inner = self.inner.build_topology(n_receivers, version, receiver_versions)
        ahead = self._ahead
        if ahead is not None and (ahead.version != version or not (
                ahead.against is None or _all_at(receiver_versions, ahead.against))):
            ahead = self._ahead = None  # the kept copy is pending, so this sync is full
        base = ahead.against if ahead is not None else self._base_version
        details = {"inner": inner, "encoded_ahead": ahead is not None,
                   "base_version": base if _all_at(receiver_versions, base) else None}
        return SyncPlan(self.name, version, n_receivers, inner.bucket_bytes, inner.timeout_s, details)

    def init_process_group(self, plan: SyncPlan, rank: int) -> None:
        """Join the inner transport; a receiver checks it holds the version the delta is against."""
        super().init_process_group(plan, rank)
        base = plan.details["base_version"]
        if rank and base is not None and (self.current_version != base or self.current_weights is None):
            raise WeightSyncError("init_process_group", "sender",
                                  f"delta against version {base}, but this receiver has version "
                                  f"{self.current_version} (current_weights "
                                  f"{'missing' if self.current_weights is None else 'given'})")
        self.inner.init_process_group(plan.details["inner"], rank)

    async def send_weights(self, named_tensors: NamedTensors) -> None:
        """Send the encoding prepared ahead (named_tensors unread) or encode the stream as it
        goes; the kept copy becomes this version on success."""
        ahead, self._ahead = self._ahead, None
        if self.plan.encoded_ahead:
            if ahead is None:
                raise RuntimeError("a plan for an encoding made ahead, but none is kept")
            records: NamedTensors = ahead.records
        else:
            if self.plan.details["base_version"] is None:
                self._base = {}
            self._base_version = None  # the copy is half-updated until the sync succeeds
            self.sparse_tensors = 0
            records = self._encode(named_tensors)
        await self.inner.send_weights(records)
        self.bytes_sent = self.inner.bytes_sent
        self._base_version = self.plan.version

    def _encode(self, named_tensors: NamedTensors) -> Iterator[tuple[str, torch.Tensor]]:
        """Wire records of the stream against the kept copy, which is updated to it."""
        for name, tensor in named_tensors:
            new = (tensor.detach().to(self.dtype) if self.dtype else tensor.detach()).contiguous()
            old = self._base.get(name)
            changed = changed_indices(new, old) if old is not None else None
            sparse_bytes = None if changed is None else \
                changed.numel() * (4 + new.element_size())
            if sparse_bytes is not None and sparse_bytes <= self.max_sparse_ratio * new.nbytes:
                self.sparse_tensors += 1
                yield from _sparse_records(name, new, old, changed)
            else:
                self._base[name] = new.clone() if new.data_ptr() == tensor.data_ptr() else new
                yield name + SEPARATOR + "dense", self._base[name]

    def receive_weights(self) -> Iterator[tuple[str, torch.Tensor | WeightPatch]]:
        """Yield dense tensors as they come; sparse ones as a checked WeightPatch where the
        receiver patches in place, else as a checked patched copy of current_weights."""
        index = values = None
        for key, tensor in self.inner.receive_weights():
            name, kind = key.rsplit(SEPARATOR, 1)
            if kind == "dense":
                yield name, tensor
            elif kind == "index":
                index = tensor.to(torch.int64, copy=True)
            elif kind == "value":
                values = tensor.clone()
            else:
                yield name, self._checked(name, WeightPatch(index, values), tensor.tolist())
                index = values = None

    def _checked(self, name: str, patch: WeightPatch, sums: list[int]
                 ) -> torch.Tensor | WeightPatch:
        old_sum, values_sum, whole_sum = sums
        self._check(name, int(byte_sum(patch.values)), values_sum, "the new values")
        if self.patches_in_place(name):
            current = self.current_values(name, patch.index)
            self._check_dtype(name, current, patch.values)
            self._check(name, int(byte_sum(current)), old_sum, "the old values")
            return patch
        current = self.current_weights(name)
        self._check_dtype(name, current, patch.values)
        result = current.detach().clone(memory_format=torch.contiguous_format)
        old = result.view(-1).index_select(0, patch.index)
        self._check(name, int(byte_sum(old)), old_sum, "the old values")
        patch.apply_to(result)
        self._check(name, int(byte_sum(result)), whole_sum, "the patched tensor")
        return result

    def _check_dtype(self, name: str, current: torch.Tensor, values: torch.Tensor) -> None:
        if current.dtype != values.dtype:
            raise WeightSyncError("receive", "sender", f"{name}: delta values are {values.dtype} "
                                  f"but the receiver holds {current.dtype} (engine_kwargs.dtype)")

    def _check(self, name: str, got: int, expected: int, what: str) -> None:
        if got != expected:
            raise WeightSyncError("receive", "sender", f"checksum mismatch for {name} ({what}) "
                                  f"in the delta against version "
                                  f"{self.plan.details['base_version']}: this receiver's weights "
                                  "differ from the sender's copy")

    def finalize(self) -> None:
        """Finalize the inner transport; an encoding prepared ahead and not sent is dropped."""
        self._ahead = None
        self.inner.finalize()
        super().finalize()

    def close(self) -> None:
        """Close the inner transport (shm's buffers) and drop the kept copy."""
        self.inner.close()
        self._base, self._base_version, self._ahead = {}, None, None


def _all_at(receiver_versions: list[int] | None, version: int | None) -> bool:
    """Whether every receiver reported `version` (never when either is unknown)."""
    return (version is not None and receiver_versions is not None
            and all(v == version for v in receiver_versions))


def _sparse_records(name: str, new: torch.Tensor, old: torch.Tensor, changed: torch.Tensor
                    ) -> Iterator[tuple[str, torch.Tensor]]:
    """index, value and sum records of `new` against `old` at `changed`; patches `old` to `new`."""
    index = changed.to(torch.int32) if new.numel() < 2**31 else changed
    values = new.reshape(-1).index_select(0, changed)
    flat_old = old.view(-1)
    sums = torch.stack([byte_sum(flat_old.index_select(0, changed)), byte_sum(values),
                        byte_sum(new)])
    flat_old.index_copy_(0, changed, values)
    yield name + SEPARATOR + "index", index
    yield name + SEPARATOR + "value", values
    yield name + SEPARATOR + "sum", sums
