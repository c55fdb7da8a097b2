"""`delta`: only the elements that changed since the receivers' version travel.

The sender keeps a copy of the weights it last synced (at the rollout dtype, `dtype` kwarg) and
the version they are. When every receiver reports that version, each tensor goes as the changed
elements (flat indices + values) if that is under `max_sparse_ratio` of its dense bytes, else
dense; a sparse tensor carries a 64-bit sum of the result's bytes, which the receiver checks
after applying the update to its `current_weights(name)`. Any receiver on another version (or
unknown versions) makes the sync a full one. Elements are compared bit for bit at the rollout
dtype, so an fp32 update too small to change a bf16 weight sends nothing. The bytes ride on an
inner transport (`transport`: shm or gloo).

Wire names: "<name>\\x00dense", or "<name>\\x00index", "<name>\\x00value", "<name>\\x00sum".
"""

from __future__ import annotations

from typing import Callable, Iterator

import torch

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


class DeltaCheckpointEngine(CheckpointEngine):
    """Sparse updates against the receivers' current weights over an inner transport."""

    name = "delta"

    def __init__(self, bucket_megabytes: int = 512, timeout_s: float = 300.0,
                 transport: str = "shm", dtype: str | None = None, max_sparse_ratio: float = 0.5,
                 current_weights: Callable[[str], torch.Tensor] | None = None,
                 current_version: int | None = None, **transport_kwargs) -> None:
        super().__init__(bucket_megabytes, timeout_s)
        if transport not in ("shm", "gloo", "nccl"):
            raise ValueError(f"delta transport must be shm, gloo or nccl, got {transport!r} "
                             "(engine_kwargs.transport)")
        if transport_kwargs.get("double_buffer"):
            raise ValueError("delta patches the receivers' current weights and cannot write a "
                             "weight slot: drop engine_kwargs.double_buffer with backend delta")
        if transport == "shm":
            transport_kwargs["double_buffer"] = False
        self.inner = get_checkpoint_engine_class(transport)(bucket_megabytes, timeout_s,
                                                            **transport_kwargs)
        self.dtype = getattr(torch, dtype) if dtype else None
        self.max_sparse_ratio = max_sparse_ratio
        self.current_weights, self.current_version = current_weights, current_version
        self._base: dict[str, torch.Tensor] = {}  # sender: what the receivers hold ...
        self._base_version: int | None = None  # ... and its version (None: nothing trusted)
        self.bytes_sent = 0
        self.sparse_tensors = 0  # sent as index + value in the last sync

    def build_topology(self, n_receivers: int, version: int,
                       receiver_versions: list[int] | None = None,
                       receiver_slots: list | None = None) -> SyncPlan:
        """Delta if every receiver holds the version of the sender's copy, else full."""
        inner = self.inner.build_topology(n_receivers, version, receiver_versions)
        delta = (self._base_version is not None and receiver_versions is not None
                 and all(v == self._base_version for v in receiver_versions))
        details = {"inner": inner, "base_version": self._base_version if delta else None}
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
        """Encode against the kept copy and send; the copy becomes this version on success."""
        if self.plan.details["base_version"] is None:
            self._base = {}
        self._base_version = None  # the copy is half-updated until the sync succeeds
        self.sparse_tensors = 0
        await self.inner.send_weights(self._encode(named_tensors))
        self.bytes_sent = self.inner.bytes_sent
        self._base_version = self.plan.version

    def _encode(self, named_tensors: NamedTensors) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in named_tensors:
            new = (tensor.detach().to(self.dtype) if self.dtype else tensor.detach()).contiguous()
            old = self._base.get(name)
            changed = changed_indices(new, old) if old is not None else None
            sparse_bytes = None if changed is None else \
                changed.numel() * (4 + new.element_size())
            if sparse_bytes is not None and sparse_bytes <= self.max_sparse_ratio * new.nbytes:
                index = changed.to(torch.int32) if new.numel() < 2**31 else changed
                values = new.reshape(-1)[changed]
                old.view(-1)[changed] = values
                self.sparse_tensors += 1
                yield name + SEPARATOR + "index", index
                yield name + SEPARATOR + "value", values
                yield name + SEPARATOR + "sum", byte_sum(old)
            else:
                self._base[name] = new.clone() if new.data_ptr() == tensor.data_ptr() else new
                yield name + SEPARATOR + "dense", new

    def receive_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield full tensors: dense ones as they come, sparse ones applied to current_weights."""
        index = values = None
        for key, tensor in self.inner.receive_weights():
            name, kind = key.rsplit(SEPARATOR, 1)
            if kind == "dense":
                yield name, tensor
            elif kind == "index":
                index = tensor.to(torch.int64)
            elif kind == "value":
                values = tensor.clone()
            else:
                yield name, self._apply(name, index, values, int(tensor))
                index = values = None

    def _apply(self, name: str, index: torch.Tensor, values: torch.Tensor, expected: int
               ) -> torch.Tensor:
        current = self.current_weights(name)
        if current.dtype != values.dtype:
            raise WeightSyncError("receive", "sender", f"{name}: delta values are {values.dtype} "
                                  f"but the receiver holds {current.dtype} (engine_kwargs.dtype)")
        result = current.detach().clone(memory_format=torch.contiguous_format)
        result.view(-1)[index] = values
        if int(byte_sum(result)) != expected:
            raise WeightSyncError("receive", "sender", f"checksum mismatch for {name} after applying "
                                  f"the delta against version {self.plan.details['base_version']}: "
                                  "this receiver's weights differ from the sender's copy")
        return result

    def finalize(self) -> None:
        """Finalize the inner transport."""
        self.inner.finalize()
        super().finalize()

    def close(self) -> None:
        """Close the inner transport (shm's buffers) and drop the kept copy."""
        self.inner.close()
        self._base, self._base_version = {}, None
