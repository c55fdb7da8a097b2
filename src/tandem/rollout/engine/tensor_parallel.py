"""Tensor parallelism of the native engine: which slice of each HF weight a rank holds, the
resharding of a full state-dict stream into those slices, and the collectives of a step.

A replica of TP ranks splits the model Megatron-style (docs/engine.md, "Tensor parallelism"):
  q/k/v_proj, gate/up_proj  column-parallel: the output rows of the rank's heads / of its share
                            of the intermediate size (their biases alike); no communication
  o_proj, down_proj         row-parallel: the matching input columns; the partial outputs are
                            summed by one all-reduce each (a bias: rank 0 holds it, the others
                            zeros, so the sum adds it once)
  embed_tokens, lm_head     vocab-parallel: rows [start, end) of the vocabulary. A lookup finds
                            each id on one rank (zeros elsewhere) and an all-reduce sums them,
                            exactly; the lm_head's logits are gathered to rank 0, which samples
                            from the full vocabulary
  norms, Qwen3 q/k norms    replicated
KV heads are split like the query heads; with fewer KV heads than ranks each KV head is
replicated on the TP / num_key_value_heads ranks whose query heads use it. A LoRA pair is cut
like its linear (adapter_slices): B's rows of a column-parallel one, A's columns of a row-parallel
one, so each rank merges its own slice.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any, Iterable, Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tandem.types import WeightPatch

logger = logging.getLogger(__name__)

COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
ROW_PARALLEL = ("o_proj", "down_proj")
VOCAB_PARALLEL = ("model.embed_tokens.weight", "lm_head.weight", "lm_head.bias")
ZEROS = "zeros"  # ShardLayout.region of a row-parallel bias on ranks > 0


@dataclass(frozen=True)
class ShardLayout:
    """Rank `rank` of `size`: the rows (heads, intermediate units, vocabulary) it holds."""

    rank: int
    size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int

    @classmethod
    def of(cls, config: Any, head_dim: int, rank: int, size: int) -> "ShardLayout":
        """The layout of an HF config's model; what does not split evenly is refused by name."""
        heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
        fix = "choose a rollout.tensor_model_parallel_size that divides it"
        if heads % size:
            raise ValueError(f"rollout.tensor_model_parallel_size={size}: the model's "
                             f"num_attention_heads={heads} do not split over {size} ranks; {fix}")
        if kv_heads % size and size % kv_heads:
            raise ValueError(f"rollout.tensor_model_parallel_size={size}: the model's "
                             f"num_key_value_heads={kv_heads} neither split over {size} ranks nor "
                             f"replicate evenly onto them; {fix} (or a multiple of it)")
        if config.intermediate_size % size:
            raise ValueError(f"rollout.tensor_model_parallel_size={size}: the model's "
                             f"intermediate_size={config.intermediate_size} does not split over "
                             f"{size} ranks; {fix}")
        return cls(rank, size, heads, kv_heads, head_dim, config.intermediate_size,
                   config.vocab_size)

    def all_ranks(self) -> list["ShardLayout"]:
        """The layouts of every rank of this one's replica, in rank order."""
        return [replace(self, rank=rank) for rank in range(self.size)]

    @property
    def local_heads(self) -> int:
        return self.num_heads // self.size

    @property
    def local_kv_heads(self) -> int:
        return max(1, self.num_kv_heads // self.size)

    def head_rows(self) -> slice:
        """Rows of q_proj (columns of o_proj) of this rank's query heads."""
        width = self.local_heads * self.head_dim
        return slice(self.rank * width, (self.rank + 1) * width)

    def kv_rows(self) -> slice:
        """Rows of k_proj / v_proj of the KV heads this rank's query heads use."""
        replicas = max(1, self.size // self.num_kv_heads)  # ranks sharing one KV head
        first = (self.rank // replicas) * self.local_kv_heads
        return slice(first * self.head_dim, (first + self.local_kv_heads) * self.head_dim)

    def kv_heads(self) -> tuple[int, ...]:
        """The model's KV heads this rank holds (kv_rows in heads)."""
        rows = self.kv_rows()
        return tuple(range(rows.start // self.head_dim, rows.stop // self.head_dim))

    def mlp_rows(self) -> slice:
        width = self.intermediate_size // self.size
        return slice(self.rank * width, (self.rank + 1) * width)

    @property
    def vocab_per_rank(self) -> int:
        return math.ceil(self.vocab_size / self.size)

    def vocab_rows(self) -> slice:
        """This rank's vocabulary ids (the last rank's share is shorter when it does not split)."""
        start = min(self.rank * self.vocab_per_rank, self.vocab_size)
        return slice(start, min(start + self.vocab_per_rank, self.vocab_size))

    def region(self, name: str) -> tuple[int, slice] | str | None:
        """Where this rank's part of HF weight `name` lies in the full tensor: (dim, indices
        along it); None: the whole tensor (replicated); ZEROS: zeros of the full shape."""
        if name in VOCAB_PARALLEL:
            return 0, self.vocab_rows()
        module, _, kind = name.rpartition(".")
        leaf = module.rpartition(".")[2]
        if leaf in COLUMN_PARALLEL:
            return 0, (self.kv_rows() if leaf in ("k_proj", "v_proj") else
                       self.head_rows() if leaf == "q_proj" else self.mlp_rows())
        if leaf in ROW_PARALLEL:
            if kind == "bias":  # added once: by rank 0 before the all-reduce
                return None if self.rank == 0 else ZEROS
            return 1, self.head_rows() if leaf == "o_proj" else self.mlp_rows()
        return None

    def slice(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's part of HF weight `name` (a view where it is one; replicated: the tensor)."""
        where = self.region(name)
        if where is None:
            return tensor
        if where == ZEROS:
            return torch.zeros_like(tensor)
        dim, indices = where
        return tensor[indices] if dim == 0 else tensor[:, indices]

    def positions(self, name: str, index: torch.Tensor, shape: torch.Size
                  ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Which flat positions `index` of the full weight `name` (of `shape`) this rank holds,
        as (a mask over `index`, their flat positions in its slice); None where it holds zeros in
        place of the weight (a row-parallel bias on ranks > 0)."""
        where = self.region(name)
        if where is None:
            return torch.ones_like(index, dtype=torch.bool), index
        if where == ZEROS:
            return None
        dim, indices = where
        columns = math.prod(shape[1:])
        row, column = index // columns, index % columns
        if dim == 0:
            mask = (row >= indices.start) & (row < indices.stop)
            return mask, index[mask] - indices.start * columns
        mask = (column >= indices.start) & (column < indices.stop)
        width = indices.stop - indices.start
        return mask, row[mask] * width + column[mask] - indices.start

    def patch_part(self, name: str, patch: WeightPatch, shape: torch.Size) -> WeightPatch | None:
        """This rank's part of a delta patch of the full weight `name`: the changes that fall in
        its slice, at its flat positions (None: it holds zeros in place of the weight)."""
        held = self.positions(name, patch.index, shape)
        if held is None:
            return None
        mask, local = held
        return WeightPatch(local, patch.values[mask])

    def adapter_slices(self, module: str, a: torch.Tensor, b: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's (A, B) of a LoRA pair on linear `module`, A [r, in], B [out, r]: B's rows
        where the linear's rows are split (column-parallel), A's columns where its columns are
        (row-parallel), the other whole; so W_slice + B_slice @ A_slice is the merge's slice."""
        key = f"{module}.weight"
        if module.rpartition(".")[2] in ROW_PARALLEL:
            return self.slice(key, a), b
        return a, self.slice(key, b)


def shard_model(model: nn.Module, layout: ShardLayout) -> dict[str, torch.Size]:
    """Keep only `layout`'s slice of every parameter of an HF model (in place, before packing);
    returns the full shapes by HF name. A linear layer this module does not know how to split
    is refused: it would silently compute a wrong result."""
    known = COLUMN_PARALLEL + ROW_PARALLEL + ("lm_head",)
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and name.rpartition(".")[2] not in known:
            raise NotImplementedError(f"tensor parallelism: linear layer {name!r} is none of "
                                      f"{known}; the native engine cannot split this model")
    full_shapes = {}
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            full_shapes[name] = parameter.shape
            part = layout.slice(name, parameter.data)
            if part is not parameter.data:
                parameter.data = part.clone(memory_format=torch.contiguous_format)
    return full_shapes


def reshard(named_tensors: Iterable[tuple[str, torch.Tensor | WeightPatch]],
            layouts: list[ShardLayout], full_shapes: dict[str, torch.Size], alias: dict[str, str]
            ) -> Iterator[tuple[str, list[torch.Tensor | WeightPatch | None]]]:
    """The resharding plan: every (HF name, full tensor) of a state-dict stream becomes
    (engine name, [the slice of rank 0, rank 1, ...]), views where slicing allows; a delta's
    WeightPatch of the full tensor becomes each rank's part (ShardLayout.patch_part; None for a
    rank that holds zeros in its place). Names and full shapes are checked here, before any rank sees the tensor; `alias` maps the names the engine
    serves under another one (a tied lm_head -> the embedding)."""
    for name, tensor in named_tensors:
        key = alias.get(name, name)
        shape = full_shapes.get(key)
        if shape is None:
            raise ValueError(f"update_weights: unknown weight {name!r} (expected HF names such "
                             f"as {next(iter(full_shapes))!r})")
        if isinstance(tensor, WeightPatch):  # a delta's changes: each rank's part, or None
            yield key, [layout.patch_part(key, tensor, shape) for layout in layouts]
            continue
        if tuple(tensor.shape) != tuple(shape):
            raise ValueError(f"update_weights: {name!r} has shape {tuple(tensor.shape)}, the "
                             f"model expects {tuple(shape)}")
        yield key, [layout.slice(key, tensor) for layout in layouts]


class TensorParallel:
    """One rank's share of a replica: its layout and the collectives of a step over `group`
    (gloo on CPU, NCCL on CUDA)."""

    def __init__(self, rank: int, size: int, group: Any) -> None:
        self.rank, self.size, self.group = rank, size, group
        self.layout: ShardLayout | None = None  # set by shard(), once the model is loaded

    def shard(self, model: nn.Module, head_dim: int) -> dict[str, torch.Size]:
        """Cut the loaded HF model down to this rank's slice; returns the full shapes."""
        self.layout = ShardLayout.of(model.config, head_dim, self.rank, self.size)
        return shard_model(model, self.layout)

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum `tensor` over the ranks, in place (the row-parallel layers' partial outputs)."""
        self.group.allreduce([tensor]).wait()
        return tensor

    def embed(self, input_ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """[T] ids -> [T, hidden] through the vocab-parallel embedding `weight` [V / TP, hidden]:
        each id is found on one rank, zeros elsewhere, so the all-reduce's sum is exact."""
        local = input_ids - self.layout.vocab_rows().start
        outside = (local < 0) | (local >= weight.shape[0])
        hidden = F.embedding(local.masked_fill(outside, 0), weight)
        hidden.masked_fill_(outside[:, None], 0.0)
        return self.all_reduce(hidden)

    def gather_logits(self, local: torch.Tensor) -> torch.Tensor | None:
        """This rank's logits [S, V / TP] -> on rank 0 the full [S, vocab] (rank order is
        vocabulary order), None elsewhere. Shares are padded to one width for the gather."""
        width = self.layout.vocab_per_rank
        if local.shape[1] < width:
            local = F.pad(local, (0, width - local.shape[1]))
        local = local.contiguous()
        parts = [torch.empty_like(local) for _ in range(self.size)] if self.rank == 0 else []
        options = dist.GatherOptions()
        options.rootRank = 0
        self.group.gather([parts] if self.rank == 0 else [], [local], options).wait()
        if self.rank != 0:
            return None
        return torch.cat(parts, dim=1)[:, :self.layout.vocab_size]


def rank_devices(device: torch.device, size: int) -> list[torch.device]:
    """The device of each rank: CPU ranks share the host; CUDA ranks take consecutive GPUs from
    `device`'s, or all share `device` when fewer are visible (a test layout, e.g. the GPU check
    on one GPU: NCCL refuses two ranks on one GPU, so make_groups then computes over gloo)."""
    if device.type != "cuda":
        return [device] * size
    first = device.index or 0
    if first + size > torch.cuda.device_count():
        logger.warning("rollout.tensor_model_parallel_size=%d from cuda:%d but %d CUDA devices "
                       "are visible: the ranks share cuda:%d and their collectives run over gloo "
                       "(a test layout, slower than one rank)", size, first,
                       torch.cuda.device_count(), first)
        return [torch.device("cuda", first)] * size
    return [torch.device("cuda", first + rank) for rank in range(size)]


def make_groups(store: dist.Store, rank: int, size: int, device: torch.device,
                timeout: timedelta, shared_device: bool = False, hostname: str = "127.0.0.1"
                ) -> tuple[Any, Any]:
    """(control, compute) process groups of a replica, private (never the default group, which
    training code may own), this rank's end bound to `hostname` (its node's address when the
    replica spans nodes): control is gloo (step plans, replies, weight slices as host tensors);
    compute is the same group on CPU or on one shared GPU, NCCL on GPUs of their own."""
    options = dist.ProcessGroupGloo._Options()
    options._timeout = timeout
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=hostname)]
    control = dist.ProcessGroupGloo(dist.PrefixStore("control/", store), rank, size, options)
    if device.type != "cuda" or shared_device:
        return control, control
    nccl_options = dist.ProcessGroupNCCL.Options()
    nccl_options._timeout = timeout
    compute = dist.ProcessGroupNCCL(dist.PrefixStore("compute/", store), rank, size, nccl_options)
    return control, compute
