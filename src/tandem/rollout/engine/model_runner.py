"""The forward pass of an HF decoder-only model (Qwen2, Llama, ...) over the paged KV cache.

The weights, RMSNorms, MLPs, projections and rotary tables are the HF model's own modules;
only the attention and the batching differ: all tokens of a step (prompt chunks and decode
tokens of every running sequence) go through one forward, flat as [T, hidden].
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from tandem.rollout.engine.attention import AttentionMetadata, build_group, paged_attention
from tandem.rollout.engine.scheduler import ScheduledSequence

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
        cos, sin = decoder.rotary_emb(probe, positions)  # the HF rotary embedding, once per position
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
        buckets = attention_buckets(batch)
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
                  for group in buckets]
        flat_end, last_index = {}, 0
        for item in ordered:
            last_index += item.num_new
            flat_end[id(item)] = last_index - 1
        sample_index = [flat_end[id(item)] for item in batch if item.samples]
        to = dict(dtype=torch.long, device=self.device)
        meta = AttentionMetadata(slots=torch.tensor(slots, **to), groups=groups)
        return (torch.tensor(ids, **to), torch.tensor(positions, **to), meta,
                torch.tensor(sample_index, **to))

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
