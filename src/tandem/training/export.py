"""Weight export for weight sync: full tensors gathered one at a time, local shards, and deltas.

Names are the HF names `save_pretrained` writes: parameters once each (a tied lm_head is
exported as model.embed_tokens.weight only) plus persistent buffers. Under FSDP2 every rank
must drain `iter_full_weights` in step: each gather is a collective.

Delta format (`TensorDelta`), one record per changed tensor or shard, against the previous
export of the same `DeltaExporter`: flat positions of the full tensor that changed bitwise and
their new values. `indices is None` means a dense run: values replace positions
[start, start + len(values)). Otherwise `indices` (int32 when the tensor has < 2**31 elements,
else int64) lists the positions. Each record takes whichever form is smaller; unchanged
tensors produce no record; the first export is dense everywhere.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import torch
from torch import nn

_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def named_weights(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(hf_name, parameter or buffer) once per distinct tensor; DTensors under FSDP2."""
    yield from model.named_parameters()
    non_persistent = {f"{prefix}.{name}" if prefix else name
                      for prefix, module in model.named_modules()
                      for name in getattr(module, "_non_persistent_buffers_set", ())}
    for name, buffer in model.named_buffers():
        if name not in non_persistent:
            yield name, buffer


def _is_dtensor(tensor: torch.Tensor) -> bool:
    return hasattr(tensor, "full_tensor")


def iter_full_weights(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(hf_name, full tensor), one tensor at a time (peak extra memory: the largest tensor).

    Unsharded tensors are yielded without a copy: copy them before the next optimizer step.
    """
    for name, tensor in named_weights(model):
        yield name, (tensor.full_tensor() if _is_dtensor(tensor) else tensor).detach()


@dataclass
class LocalShard:
    """This rank's piece of one tensor: flat positions [start, start + tensor.numel()) of the full one."""

    name: str
    tensor: torch.Tensor
    full_shape: tuple[int, ...]
    start: int


def iter_local_shards(model: nn.Module) -> Iterator[LocalShard]:
    """This rank's shards, no communication. FSDP2 shards dim 0, so a shard is one flat run."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    for name, tensor in named_weights(model):
        if not _is_dtensor(tensor):
            yield LocalShard(name, tensor.detach(), tuple(tensor.shape), 0)
            continue
        local = tensor.to_local().detach()
        _, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
        row = int(torch.Size(tensor.shape[1:]).numel())
        if any(o != 0 for o in offset[1:]):
            raise ValueError(f"iter_local_shards: {name} is sharded on a dimension other than 0")
        yield LocalShard(name, local, tuple(tensor.shape), int(offset[0]) * row if tensor.dim() else 0)


@dataclass
class TensorDelta:
    """Changed values of one tensor (or shard) since the last export; see the module docstring."""

    name: str
    full_shape: tuple[int, ...]
    dtype: torch.dtype
    start: int
    indices: torch.Tensor | None
    values: torch.Tensor

    def nbytes(self) -> int:
        """Bytes on the wire (values plus indices)."""
        size = self.values.numel() * self.values.element_size()
        return size + (self.indices.numel() * self.indices.element_size() if self.indices is not None else 0)


def apply_delta(full: torch.Tensor, delta: TensorDelta) -> None:
    """Write a delta into the receiver's full tensor in place."""
    if tuple(full.shape) != delta.full_shape:
        raise ValueError(f"apply_delta: {delta.name} has shape {delta.full_shape}, target {tuple(full.shape)}")
    flat = full.view(-1)
    values = delta.values.to(device=full.device, dtype=full.dtype)
    if delta.indices is None:
        flat[delta.start:delta.start + values.numel()] = values
    else:
        flat[delta.indices.to(full.device).long()] = values


class DeltaExporter:
    """Deltas of this rank's shards against its previous export (keeps one CPU copy of them)."""

    def __init__(self) -> None:
        self._previous: dict[str, torch.Tensor] = {}

    def export(self, model: nn.Module) -> Iterator[TensorDelta]:
        """Yield a TensorDelta for each shard that changed; the baseline moves to this export."""
        for shard in iter_local_shards(model):
            current = shard.tensor.reshape(-1).to("cpu", copy=True)
            previous = self._previous.get(shard.name)
            self._previous[shard.name] = current
            delta = self._diff(shard, current, previous)
            if delta is not None:
                yield delta

    @staticmethod
    def _diff(shard: LocalShard, current: torch.Tensor, previous: torch.Tensor | None) -> TensorDelta | None:
        dense = TensorDelta(shard.name, shard.full_shape, current.dtype, shard.start, None, current)
        if previous is None or previous.shape != current.shape:
            return dense
        bits = _BITS[current.element_size()]
        changed = (current.view(bits) != previous.view(bits)).nonzero().flatten()
        if changed.numel() == 0:
            return None
        full_numel = int(torch.Size(shard.full_shape).numel())
        index_dtype = torch.int32 if full_numel < 2**31 else torch.int64
        indices = (changed + shard.start).to(index_dtype)
        sparse = TensorDelta(shard.name, shard.full_shape, current.dtype, shard.start, indices, current[changed])
        return sparse if sparse.nbytes() < dense.nbytes() else dense
