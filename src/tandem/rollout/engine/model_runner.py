"""The forward pass of an HF decoder-only model (Qwen2, Llama, ...) over the paged KV cache.

The weights, RMSNorms, MLPs, projections and rotary tables are the HF model's own modules;
only the attention and the batching differ: all tokens of a step (prompt chunks and decode
tokens of every running sequence) go through one forward, flat as [T, hidden]. On CPU in fp32
the linear layers run through oneDNN with prepacked weights (`PackedLinear`) and the rest of
the layer through fused kernels (`cpu_kernels.py`: RMSNorm with the residual add, rotary with
the KV write, decode attention, silu * up), where the model's modules allow it
(`fused_kernels_supported`); otherwise the layer is the HF modules plus torch ops.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Generator
from dataclasses import dataclass
from itertools import chain
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tandem import cpu_kernels
from tandem.rollout.engine.attention import (AttentionMetadata, build_cascade_group,
                                             build_decode_group, build_group, paged_attention,
                                             write_kv)
from tandem.rollout.engine.hf_model import (PackedLinear, check_supported, decoder_of,
                                            fused_kernels_supported, load_model, pack_linears,
                                            text_config, uses_onednn)
from tandem.rollout.engine.scheduler import ScheduledSequence
from tandem.rollout.engine.shared_kv import SharedCache
from tandem.rollout.engine.tensor_parallel import TensorParallel
from tandem.rollout.engine.vision import VisionTower, step_vision

# Decode attention splits shared prefixes off (cascade) when that avoids reading at least this
# fraction of the decode group's K/V.
CASCADE_MIN_SAVING = 0.25

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def torch_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"dtype {name!r}: use one of {list(DTYPES)}")
    return DTYPES[name]


@dataclass
class StepPlan:
    """One step as plain lists: rank 0 plans it from the scheduled batch, and every rank of a
    tensor-parallel replica runs it (rank_worker.py). The flat tokens in attention-group order,
    their positions and KV slots; the attention groups, each `(kind, *arguments)` of its build
    function (prefill: build_group's starts, lengths, block tables; decode: build_decode_group's
    tables and contexts; cascade: build_cascade_group's tables, contexts, shared blocks,
    families); the flat index of each sampling sequence's last token, in batch order."""

    input_ids: list[int]
    positions: list[int]
    slots: list[int]
    groups: list[tuple]
    sample_index: list[int]
    # a vision-language model's step with images (one rank only): every token's (t, h, w)
    # positions, and (flat index, rows) of the vision embeddings that replace image tokens'
    mrope: list[list[int]] | None = None
    vision_rows: list[tuple[int, torch.Tensor]] | None = None


def attention_buckets(batch: list[ScheduledSequence]) -> list[list[ScheduledSequence]]:
    """Split a step into attention groups of similar query length (within 2x) and context
    (within 1.5x): a group is padded to its longest member, so this bounds the wasted work."""
    items = sorted(batch, key=lambda item: (item.num_new, item.start + item.num_new), reverse=True)
    buckets: list[list[ScheduledSequence]] = []
    for item in items:
        if buckets:
            first = buckets[-1][0]
            if (item.num_new * 2 > first.num_new and (item.num_new == 1) == (first.num_new == 1)
                    and (item.start + item.num_new) * 1.5 >= first.start + first.num_new):
                buckets[-1].append(item)
                continue
        buckets.append([item])
    return buckets


class ModelRunner:
    """Holds the HF model and the KV cache; `forward_layers` computes one step's logits. With
    `tensor_parallel` it holds that rank's slice of the model (tensor_parallel.py) and its
    step sums and gathers over the replica's ranks."""

    def __init__(self, model_path: str | Path, dtype: torch.dtype, device: torch.device,
                 tensor_parallel: TensorParallel | None = None) -> None:
        self.device = device
        self.dtype = dtype
        model = load_model(model_path, dtype)
        self.model = model.to(device).eval().requires_grad_(False)
        config = text_config(model)
        self.config = config
        check_supported(model)
        decoder = decoder_of(model)
        # a vision-language model's tower, image processor and 3-D positions (vision.py)
        self.vision = VisionTower(model, model_path) if decoder is not model.model else None
        if self.vision is not None and tensor_parallel is not None:
            raise ValueError("rollout.tensor_model_parallel_size: a vision-language model runs "
                             "on one rank in the native engine (its vision tower is not split "
                             "over ranks); set it to 1")
        self.tensor_parallel = tensor_parallel
        # HF name -> full shape; with tensor parallelism the parameters hold this rank's slice
        self.full_shapes = (tensor_parallel.shard(model, decoder.layers[0].self_attn.head_dim)
                            if tensor_parallel is not None else
                            {name: p.shape for name, p in model.named_parameters()})
        self.reduce = tensor_parallel.all_reduce if tensor_parallel is not None else _unchanged
        self.embed_tokens = decoder.embed_tokens
        self.layers = list(decoder.layers)
        self.norm = decoder.norm
        # CPU fp32: the linears hold only packed weights; a tied lm_head gets a packed copy of
        # the embedding (which stays dense for the lookup), re-packed when the embedding changes
        tied = model.lm_head.weight is decoder.embed_tokens.weight
        self.packed_linears = pack_linears(model) if uses_onednn(device, dtype) else {}
        self.tied_lm_head = tied and bool(self.packed_linears)
        self.lm_head = model.lm_head
        self.lm_head_source: tuple[int, int] | None = None  # embedding (data_ptr, version) packed
        if self.tied_lm_head:
            self.lm_head = PackedLinear(model.lm_head.weight, model.lm_head.bias)
            self.lm_head_source = _version_key(model.lm_head.weight)
        attention = self.layers[0].self_attn
        self.head_dim = attention.head_dim
        self.scale = attention.scaling
        layout = tensor_parallel.layout if tensor_parallel is not None else None
        self.num_heads = layout.local_heads if layout else config.num_attention_heads
        self.num_kv_heads = layout.local_kv_heads if layout else config.num_key_value_heads
        self.max_model_len = config.max_position_embeddings
        self.vocab_size = config.vocab_size
        self.eos_token_ids = _eos_token_ids(model)
        positions = torch.arange(self.max_model_len, device=device)[None]
        probe = torch.zeros(1, dtype=dtype, device=device)
        self.rotary = decoder.rotary_emb
        cos, sin = self.rotary(probe, positions)  # HF's rotary embedding, every position
        self.cos, self.sin = cos[0].contiguous(), sin[0].contiguous()  # [max_len, head_dim]
        # the fused CPU kernels, or None: the HF modules and torch ops (CUDA, bf16, fallback)
        self.kernels = (cpu_kernels.load() if self.packed_linears and fused_kernels_supported(
            model) and self.cos.shape[-1] == self.head_dim else None)
        self.key_caches: list[torch.Tensor] = []
        self.value_caches: list[torch.Tensor] = []
        self.block_size = 0
        # set: the KV cache lives in a file of this directory (shared_kv.py, a PD replica's shm)
        self.kv_shm_dir: str | None = None
        self.shared_cache: SharedCache | None = None

    # ---- KV cache -------------------------------------------------------------------------
    def block_bytes(self, block_size: int) -> int:
        """Bytes of one KV block across all layers (keys and values)."""
        element = torch.empty(0, dtype=self.dtype).element_size()
        return 2 * len(self.layers) * block_size * self.num_kv_heads * self.head_dim * element

    def allocate_kv_cache(self, num_blocks: int, block_size: int) -> None:
        shape = (self.num_kv_heads, num_blocks, block_size, self.head_dim)
        self.block_size = block_size
        if self.kv_shm_dir is not None:
            heads = (self.tensor_parallel.layout.kv_heads() if self.tensor_parallel else
                     tuple(range(self.num_kv_heads)))  # the model's KV heads, in cache order
            tp = self.tensor_parallel  # rank 0 allocates first: it checks room for every rank
            ranks = tp.size if tp is not None and tp.rank == 0 else 1
            self.shared_cache = SharedCache(len(self.layers), shape, self.dtype, heads,
                                            self.kv_shm_dir, ranks)
            self.key_caches = self.shared_cache.key_caches
            self.value_caches = self.shared_cache.value_caches
            return
        # zeros, not empty: masked-out slots are still multiplied by 0, and 0 * NaN is NaN
        self.key_caches = [torch.zeros(shape, dtype=self.dtype, device=self.device)
                           for _ in self.layers]
        self.value_caches = [torch.zeros(shape, dtype=self.dtype, device=self.device)
                             for _ in self.layers]

    def free_kv_cache(self) -> None:
        self.key_caches = []
        self.value_caches = []
        if self.shared_cache is not None:
            self.shared_cache.close()
            self.shared_cache = None

    def kv_cache_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.key_caches + self.value_caches)

    # ---- forward --------------------------------------------------------------------------
    def plan_step(self, batch: list[ScheduledSequence]) -> StepPlan:
        """The step's flat tokens, their positions and slots, its attention groups and sampling
        rows, as plain lists (StepPlan); `forward_layers` runs it."""
        size = self.block_size
        decode = [item for item in batch if item.num_new == 1]
        # the tokens that attend from one query position: one kernel call for all of them, or
        # cascade attention if shared prefixes make it worth it, or the ordinary buckets
        if self.kernels is not None and decode:
            decode_group = ("decode", [item.seq.block_table for item in decode],
                            [item.start + 1 for item in decode])
        else:
            decode_group = self._cascade_plan(decode) if len(decode) > 1 else None
        if decode_group is None:
            buckets = attention_buckets(batch)
        else:
            buckets = attention_buckets([item for item in batch if item.num_new > 1]) + [decode]
        ordered = [item for bucket in buckets for item in bucket]
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        for item in ordered:
            seq, start, end = item.seq, item.start, item.start + item.num_new
            ids.extend(seq.token_ids[start:end])
            table = seq.block_table
            for position in range(start, end):
                positions.append(position)
                slots.append(table[position // size] * size + position % size)
        groups = [("prefill", [item.start for item in group], [item.num_new for item in group],
                   [item.seq.block_table for item in group])
                  for group in (buckets if decode_group is None else buckets[:-1])]
        if decode_group is not None:
            groups.append(decode_group)
        flat_end, last_index = {}, 0
        for item in ordered:
            last_index += item.num_new
            flat_end[id(item)] = last_index - 1
        sample_index = [flat_end[id(item)] for item in batch if item.samples]
        return StepPlan(ids, positions, slots, groups, sample_index,
                        *step_vision(ordered, self.vision))

    def _tensors(self, plan: StepPlan) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata,
                                                torch.Tensor]:
        """Flat input ids and positions [T], attention metadata (this rank's KV heads), and
        the index [S] of the last token of each sequence that samples."""
        to = dict(dtype=torch.long, device=self.device)
        meta = AttentionMetadata(slots=torch.tensor(plan.slots, **to),
                                 groups=[self._build_group(*group) for group in plan.groups])
        return (torch.tensor(plan.input_ids, **to), torch.tensor(plan.positions, **to), meta,
                torch.tensor(plan.sample_index, **to))

    def _build_group(self, kind: str, *arguments) -> Any:
        """One attention group of a StepPlan as the attention code takes it."""
        if kind == "decode":
            return build_decode_group(*arguments, self.device)
        build = build_group if kind == "prefill" else build_cascade_group
        return build(*arguments, self.block_size, self.num_kv_heads, self.head_dim, self.dtype,
                     self.device)

    def _cascade_plan(self, decode: list[ScheduledSequence]) -> tuple | None:
        """Cascade metadata for the decode tokens if their shared prefixes are worth it.
        A row's shared prefix is its leading blocks that other decoding rows hold too; rows
        whose shared prefix ends in the same block form a family (blocks are shared only by
        whole prefix chains, so a family shares every block up to that one). Reorders
        `decode` in place (the step's flat tokens follow it): longest suffix first."""
        size = self.block_size
        holders = Counter(chain.from_iterable(item.seq.block_table for item in decode))
        shared = {}
        by_last_block = defaultdict(list)
        for item in decode:
            table, blocks, limit = item.seq.block_table, 0, item.start // size
            while blocks < limit and holders[table[blocks]] > 1:  # limit: the new token's block
                blocks += 1
            shared[id(item)] = blocks
            if blocks:
                by_last_block[table[blocks - 1]].append(item)
        families = [items for items in by_last_block.values() if len(items) > 1]
        saved = size * sum((len(items) - 1) * shared[id(items[0])] for items in families)
        if saved < CASCADE_MIN_SAVING * sum(item.start + 1 for item in decode):
            return None
        in_family = {id(item) for items in families for item in items}
        blocks_of = {key: (blocks if key in in_family else 0) for key, blocks in shared.items()}
        decode.sort(key=lambda item: blocks_of[id(item)] * size - item.start)
        row = {id(item): index for index, item in enumerate(decode)}
        return ("cascade", [item.seq.block_table for item in decode],
                [item.start + 1 for item in decode], [blocks_of[id(item)] for item in decode],
                [[row[id(item)] for item in items] for items in families])

    @torch.inference_mode()
    def forward_layers(self, plan: StepPlan) -> Generator[None, None, torch.Tensor | None]:
        """One step's forward as a generator that pauses after every decoder layer (the engine
        yields to its event loop there during long steps); its return value is the fp32 logits
        [S, vocab] of the sequences that sample (None on the other ranks of a replica)."""
        input_ids, positions, meta, sample_index = self._tensors(plan)
        tensor_parallel = self.tensor_parallel
        if tensor_parallel is None:
            hidden = self.embed_tokens(input_ids)  # [T, hidden]
        else:
            hidden = tensor_parallel.embed(input_ids, self.embed_tokens.weight)
        rope = (self.cos, self.sin, positions)
        if plan.mrope is not None:  # each token's rows of the tables, from its (t, h, w)
            cos, sin = self.rotary(hidden, torch.tensor(plan.mrope, device=self.device)[:, None])
            rope = (cos[0].contiguous(), sin[0].contiguous(),
                    torch.arange(len(plan.input_ids), device=self.device))
            for flat, rows in plan.vision_rows:
                hidden[flat:flat + len(rows)] = rows
        if self.kernels is not None:
            hidden = yield from self._layers_fused(hidden, rope, meta, sample_index)
        else:
            hidden = yield from self._layers_torch(hidden, rope, meta, sample_index)
        if self.tied_lm_head:
            self.refresh_tied_lm_head()
        logits = self.lm_head(hidden).float()
        return logits if tensor_parallel is None else tensor_parallel.gather_logits(logits)

    def _layers_torch(self, hidden: torch.Tensor, rope: tuple, meta: AttentionMetadata,
                      sample_index: torch.Tensor) -> Generator:
        """The decoder layers with the HF modules and torch ops; returns the final-normed hidden
        states of the sampling rows. `rope`: the rotary tables and each token's row in them."""
        cos_table, sin_table, positions = rope
        cos = cos_table[positions][:, None, :]  # [T, 1, D]
        sin = sin_table[positions][:, None, :]
        half = self.head_dim // 2
        for layer, key_cache, value_cache in zip(self.layers, self.key_caches, self.value_caches):
            attention = layer.self_attn
            residual = hidden
            q, k, v = self._project_qkv(attention, layer.input_layernorm(hidden))
            q = q * cos + torch.cat((-q[..., half:], q[..., :half]), dim=-1) * sin
            k = k * cos + torch.cat((-k[..., half:], k[..., :half]), dim=-1) * sin
            write_kv(k, v, key_cache, value_cache, meta.slots)
            out = paged_attention(q, key_cache, value_cache, meta, self.scale)
            hidden = residual + self.reduce(attention.o_proj(out))
            residual = hidden
            hidden = residual + self.reduce(layer.mlp(layer.post_attention_layernorm(hidden)))
            yield
        return self.norm(hidden.index_select(0, sample_index))

    def _layers_fused(self, hidden: torch.Tensor, rope: tuple, meta: AttentionMetadata,
                      sample_index: torch.Tensor) -> Generator:
        """The same layers through the fused CPU kernels; `hidden` is the residual stream,
        updated in place, `normed` the input of the next block."""
        ops, layers = self.kernels, self.layers
        cos_table, sin_table, positions = rope
        first = layers[0].input_layernorm
        normed = ops.rms_norm(hidden, first.weight, first.variance_epsilon)
        for index, (layer, key_cache, value_cache) in enumerate(
                zip(layers, self.key_caches, self.value_caches)):
            attention = layer.self_attn
            q, k, v = self._project_qkv(attention, normed)
            ops.rotary_write_kv(q, k, v, cos_table, sin_table, positions, meta.slots, key_cache,
                                value_cache)
            out = paged_attention(q, key_cache, value_cache, meta, self.scale)
            norm = layer.post_attention_layernorm
            normed = ops.add_rms_norm_(hidden, self.reduce(attention.o_proj(out)), norm.weight,
                                       norm.variance_epsilon)
            mlp = layer.mlp
            down = self.reduce(mlp.down_proj(ops.silu_and_mul(mlp.gate_proj(normed),
                                                              mlp.up_proj(normed))))
            if index + 1 < len(layers):
                norm = layers[index + 1].input_layernorm
                normed = ops.add_rms_norm_(hidden, down, norm.weight, norm.variance_epsilon)
            else:
                hidden += down
            yield
        return ops.rms_norm(hidden.index_select(0, sample_index), self.norm.weight,
                            self.norm.variance_epsilon)

    def _project_qkv(self, attention: nn.Module, normed: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [T, H, D], k and v [T, KVH, D] of a layer's normed input (Qwen3 q/k norms applied)."""
        q = attention.q_proj(normed).view(-1, self.num_heads, self.head_dim)
        k = attention.k_proj(normed).view(-1, self.num_kv_heads, self.head_dim)
        v = attention.v_proj(normed).view(-1, self.num_kv_heads, self.head_dim)
        if hasattr(attention, "q_norm"):  # Qwen3-style per-head norms
            q, k = attention.q_norm(q), attention.k_norm(k)
        return q, k, v

    def refresh_tied_lm_head(self) -> None:
        """Re-pack the tied lm_head if the embedding was written (update_weights, a refill after
        sleep, or any in-place edit: each bumps the tensor's version counter)."""
        embedding = self.embed_tokens.weight
        if self.lm_head.packed is None or self.lm_head_source != _version_key(embedding):
            self.lm_head.load(embedding)
            self.lm_head_source = _version_key(embedding)

    # ---- weights --------------------------------------------------------------------------
    def named_parameters(self) -> dict[str, nn.Parameter]:
        """The HF parameters still held dense (all of them unless the linears are packed)."""
        return dict(self.model.named_parameters())

    def stage_form(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """What swap_weight installs for a checked engine-dtype host weight: a packed linear's
        weight packed (a copy), any other weight the tensor itself."""
        return PackedLinear.pack(tensor) if name in self.packed_linears else tensor

    def swap_weight(self, name: str, tensor: torch.Tensor) -> None:
        """Install one staged weight (stage_form of a checked, engine-dtype, host copy): packed
        linears take their packed tensor, dense CPU parameters the tensor itself (no copy),
        device parameters copy it in."""
        linear = self.packed_linears.get(name)
        if linear is not None:
            linear.packed = tensor
            return
        parameter = self.model.get_parameter(name)
        if parameter.device == tensor.device:
            parameter.data = tensor
        else:
            with torch.no_grad():
                parameter.copy_(tensor)

    def dense_weight(self, name: str) -> torch.Tensor:
        """The HF-named weight as a dense tensor (a packed linear is unpacked)."""
        linear = self.packed_linears.get(name)
        if linear is not None:
            return linear.packed.to_dense()
        return self.model.get_parameter(name).detach()

    def packed_bytes(self) -> int:
        linears = list(self.packed_linears.values()) + ([self.lm_head] if self.tied_lm_head else [])
        return sum(linear.nbytes() for linear in linears)

    def release_packed(self) -> None:
        for linear in self.packed_linears.values():
            linear.release()
        if self.tied_lm_head:
            self.lm_head.release()


def _unchanged(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def _version_key(tensor: torch.Tensor) -> tuple[int, int]:
    return tensor.data_ptr(), tensor._version


def _eos_token_ids(model) -> frozenset[int]:
    """The token ids that end a sequence: the model config's and generation config's eos."""
    ids: set[int] = set()
    for source in (model.config, getattr(model, "generation_config", None)):
        value = getattr(source, "eos_token_id", None)
        if isinstance(value, int):
            ids.add(value)
        elif value:
            ids.update(int(v) for v in value)
    return frozenset(ids)
