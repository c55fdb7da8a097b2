"""Weight export for weight sync: full tensors gathered one at a time, and local shards.

Names are the HF names `save_pretrained` writes: parameters once each (a tied lm_head is
exported as model.embed_tokens.weight only) plus persistent buffers. Under FSDP2 every rank
must drain `iter_full_weights` in step: each gather is a collective. Deltas against the
receivers' version are the `delta` checkpoint engine's (weight_sync/delta.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import torch
from torch import nn


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
    """(hf_name, full tensor), one tensor at a time (peak extra memory: the largest tensor);
    unsharded tensors come without a copy, so copy them before the next optimizer step."""
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
