"""The forward pass of an HF decoder-only model (Qwen2, Llama, ...) over the paged KV cache.

The weights, RMSNorms, MLPs, projections and rotary tables are the HF model's own modules;
only the attention and the batching differ: all tokens of a step (prompt chunks and decode
tokens of every running sequence) go through one forward, flat as [T, hidden].
"""

from __future__ import annotations

from collections import Counter, defaultdict
from itertools import chain
from pathlib import Path

import torch
from torch import nn

from tandem.rollout.engine.attention import (AttentionMetadata, CascadeGroup, build_cascade_group,
                                             build_group, paged_attention)
from tandem.rollout.engine.scheduler import ScheduledSequence

# Decode attention splits shared prefixes off (cascade) when that avoids reading at least this
# fraction of the decode group's K/V.
CASCADE_MIN_SAVING = 0.25

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def torch_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"dtype {name!r}: use one of {list(DTYPES)}")
    return DTYPES[name]


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


def _check_supported(model) -> None:
    """Refuse what this runner would silently get wrong."""
    config = model.config
    if "sliding_attention" in (getattr(config, "layer_types", None) or ()):
        raise NotImplementedError(f"{config.model_type}: sliding-window attention layers are not "
                                  "supported by the native engine")
    rope_type = getattr(model.model.rotary_emb, "rope_type", "default")
    if rope_type in ("dynamic", "longrope"):
        raise NotImplementedError(f"rope_type {rope_type!r} depends on the sequence length; the "
                                  "native engine precomputes one rotary table")
    for name in ("embed_tokens", "layers", "norm", "rotary_emb"):
        if not hasattr(model.model, name):
            raise NotImplementedError(f"{type(model).__name__} is not a Llama/Qwen2-style decoder "
                                      f"(no model.{name})")


class ModelRunner:
    """Holds the HF model and the KV cache; `forward` computes one step's logits."""

    def __init__(self, model_path: str | Path, dtype: torch.dtype, device: torch.device) -> None:
        from transformers import AutoModelForCausalLM

        self.device = device
        self.dtype = dtype
        model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=dtype)
        self.model = model.to(device).eval().requires_grad_(False)
        config = model.config
        self.config = config
        _check_supported(model)
        decoder = model.model
        self.embed_tokens = decoder.embed_tokens
        self.layers = list(decoder.layers)
        self.norm = decoder.norm
        self.lm_head = model.lm_head
        attention = self.layers[0].self_attn
        self.head_dim = attention.head_dim
        self.scale = attention.scaling
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.max_model_len = config.max_position_embeddings
        self.vocab_size = config.vocab_size
        positions = torch.arange(self.max_model_len, device=device)[None]
        probe = torch.zeros(1, dtype=dtype, device=device)
        cos, sin = decoder.rotary_emb(probe, positions)  # HF's rotary embedding, every position
        self.cos, self.sin = cos[0], sin[0]  # [max_model_len, head_dim]
        self.key_caches: list[torch.Tensor] = []
        self.value_caches: list[torch.Tensor] = []
        self.block_size = 0

    # ---- KV cache -------------------------------------------------------------------------
    def block_bytes(self, block_size: int) -> int:
        """Bytes of one KV block across all layers (keys and values)."""
        element = torch.empty(0, dtype=self.dtype).element_size()
        return 2 * len(self.layers) * block_size * self.num_kv_heads * self.head_dim * element

    def allocate_kv_cache(self, num_blocks: int, block_size: int) -> None:
        shape = (self.num_kv_heads, num_blocks, block_size, self.head_dim)
        # zeros, not empty: masked-out slots are still multiplied by 0, and 0 * NaN is NaN
        self.key_caches = [torch.zeros(shape, dtype=self.dtype, device=self.device)
                           for _ in self.layers]
        self.value_caches = [torch.zeros(shape, dtype=self.dtype, device=self.device)
                             for _ in self.layers]
        self.block_size = block_size

    def free_kv_cache(self) -> None:
        self.key_caches = []
        self.value_caches = []

    def kv_cache_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.key_caches + self.value_caches)

    # ---- forward --------------------------------------------------------------------------
    def prepare(self, batch: list[ScheduledSequence]) -> tuple[torch.Tensor, torch.Tensor,
                                                               AttentionMetadata, torch.Tensor]:
        """Flat input ids and positions [T], attention metadata, and the index [S] of the
        last token of each sequence that samples this step (in batch order)."""
        size = self.block_size
        decode = [item for item in batch if item.num_new == 1]
        cascade = self._cascade_group(decode) if len(decode) > 1 else None
        if cascade is None:
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
        groups = [build_group([item.start for item in group], [item.num_new for item in group],
                              [item.seq.block_table for item in group], size, self.num_kv_heads,
                              self.head_dim, self.dtype, self.device)
                  for group in (buckets if cascade is None else buckets[:-1])]
        if cascade is not None:
            groups.append(cascade)
        flat_end, last_index = {}, 0
        for item in ordered:
            last_index += item.num_new
            flat_end[id(item)] = last_index - 1
        sample_index = [flat_end[id(item)] for item in batch if item.samples]
        to = dict(dtype=torch.long, device=self.device)
        meta = AttentionMetadata(slots=torch.tensor(slots, **to), groups=groups)
        return (torch.tensor(ids, **to), torch.tensor(positions, **to), meta,
                torch.tensor(sample_index, **to))

    def _cascade_group(self, decode: list[ScheduledSequence]) -> CascadeGroup | None:
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
        return build_cascade_group(
            [item.seq.block_table for item in decode], [item.start + 1 for item in decode],
            [blocks_of[id(item)] for item in decode],
            [[row[id(item)] for item in items] for items in families],
            size, self.num_kv_heads, self.head_dim, self.dtype, self.device)

    @torch.inference_mode()
    def forward(self, batch: list[ScheduledSequence]) -> torch.Tensor:
        """Run one step; returns fp32 logits [S, vocab] for the sequences that sample."""
        input_ids, positions, meta, sample_index = self.prepare(batch)
        hidden = self.embed_tokens(input_ids)  # [T, hidden]
        cos = self.cos[positions][:, None, :]  # [T, 1, D]
        sin = self.sin[positions][:, None, :]
        half = self.head_dim // 2
        for layer, key_cache, value_cache in zip(self.layers, self.key_caches, self.value_caches):
            attention = layer.self_attn
            residual = hidden
            hidden = layer.input_layernorm(hidden)
            q = attention.q_proj(hidden).view(-1, self.num_heads, self.head_dim)
            k = attention.k_proj(hidden).view(-1, self.num_kv_heads, self.head_dim)
            v = attention.v_proj(hidden).view(-1, self.num_kv_heads, self.head_dim)
            if hasattr(attention, "q_norm"):  # Qwen3-style per-head norms
                q, k = attention.q_norm(q), attention.k_norm(k)
            q = q * cos + torch.cat((-q[..., half:], q[..., :half]), dim=-1) * sin
            k = k * cos + torch.cat((-k[..., half:], k[..., :half]), dim=-1) * sin
            out = paged_attention(q, k, v, key_cache, value_cache, meta, self.scale)
            hidden = residual + attention.o_proj(out)
            residual = hidden
            hidden = residual + layer.mlp(layer.post_attention_layernorm(hidden))
        hidden = self.norm(hidden.index_select(0, sample_index))
        return self.lm_head(hidden).float()

    # ---- weights --------------------------------------------------------------------------
    def named_parameters(self) -> dict[str, nn.Parameter]:
        return dict(self.model.named_parameters())
