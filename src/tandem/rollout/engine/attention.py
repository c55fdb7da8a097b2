"""Attention over the paged KV cache, for a step that mixes prompt chunks and decode tokens.

The step's tokens are flat, group after group (groups of similar query length and context, see
`model_runner.attention_buckets`; decode tokens form one group). Each layer writes the new
keys/values into their cache slots, then each group gathers its sequences' blocks (one
`index_select` into a buffer reused by every layer of the step) and runs one batched
scaled-dot-product attention. (A dense per-sequence copy of the decode K/V kept across steps,
to skip the gather, measured no faster on CPU: the gather is a memcpy of what attention reads
anyway.)

Cache layout per layer: [kv_heads, num_blocks, block_size, head_dim]. Gathering a group's
block tables along dim 1 gives [kv_heads, B, context, head_dim] contiguous, so each (kv head,
sequence) pair is one attention "batch" entry whose query heads are the G = heads / kv_heads
heads sharing that kv head: no repeat of K/V for grouped-query attention.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class AttentionGroup:
    """Sequences of one group, padded to the same query length Q and attended context L.

    block_ids: [B * blocks_per_row] flat block tables, padded with block 0;
    mask: [kv_heads * B, 1, Q, L] (True = attend); query_index: flat token -> row of the
    padded [B * Q] queries (None when no padding is needed);
    key_buffer/value_buffer: [kv_heads, B * blocks_per_row, block_size, head_dim] gather targets.
    """

    num_seqs: int
    query_len: int
    context_len: int
    num_tokens: int
    block_ids: torch.Tensor
    mask: torch.Tensor
    query_index: torch.Tensor | None
    key_buffer: torch.Tensor
    value_buffer: torch.Tensor


@dataclass
class AttentionMetadata:
    slots: torch.Tensor  # [T] cache slot (block * block_size + offset) of every new token
    groups: list[AttentionGroup]  # in the order of the flat tokens


def write_kv(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
             value_cache: torch.Tensor, slots: torch.Tensor) -> None:
    """key/value [T, KVH, D] into caches [KVH, num_blocks, block_size, D] at `slots`."""
    kv_heads, _, _, head_dim = key_cache.shape
    key_cache.view(kv_heads, -1, head_dim).index_copy_(1, slots, key.transpose(0, 1))
    value_cache.view(kv_heads, -1, head_dim).index_copy_(1, slots, value.transpose(0, 1))


def paged_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    key_cache: torch.Tensor, value_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """query [T, H, D], key/value [T, KVH, D] of the step's tokens -> output [T, H * D]."""
    write_kv(key, value, key_cache, value_cache, meta.slots)
    kv_heads, _, block_size, head_dim = key_cache.shape
    groups_per_kv = query.shape[1] // kv_heads
    outputs = []
    offset = 0
    for group in meta.groups:
        q = query[offset:offset + group.num_tokens]
        offset += group.num_tokens
        batch, q_len, context = group.num_seqs, group.query_len, group.context_len
        if group.query_index is not None:
            padded = q.new_zeros(batch * q_len, *q.shape[1:])
            padded.index_copy_(0, group.query_index, q)
            q = padded
        torch.index_select(key_cache, 1, group.block_ids, out=group.key_buffer)
        torch.index_select(value_cache, 1, group.block_ids, out=group.value_buffer)
        k = group.key_buffer.view(kv_heads * batch, 1, -1, head_dim)[:, :, :context]
        v = group.value_buffer.view(kv_heads * batch, 1, -1, head_dim)[:, :, :context]
        # [B, Q, KVH, G, D] -> [KVH, B, G, Q, D]: one attention batch entry per (kv head, seq)
        q = q.view(batch, q_len, kv_heads, groups_per_kv, head_dim).permute(2, 0, 3, 1, 4)
        if q_len == 1:  # decode: the G query heads become G query rows of one head
            q = q.reshape(kv_heads * batch, 1, groups_per_kv, head_dim)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=group.mask, scale=scale)
        else:
            q = q.reshape(kv_heads * batch, groups_per_kv, q_len, head_dim)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=group.mask, scale=scale,
                                                 enable_gqa=True)
        # [KVH, B, G, Q, D] -> [B, Q, KVH * G * D]
        out = out.view(kv_heads, batch, groups_per_kv, q_len, head_dim).permute(1, 3, 0, 2, 4)
        out = out.reshape(batch * q_len, -1)
        if group.query_index is not None:
            out = out.index_select(0, group.query_index)
        outputs.append(out)
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs)


def build_group(starts: list[int], lengths: list[int], block_tables: list[list[int]],
                block_size: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                device: torch.device) -> AttentionGroup:
    """Metadata of one group: sequence i computes tokens [starts[i], starts[i] + lengths[i])."""
    batch = len(starts)
    q_len = max(lengths)
    blocks_per_row = max(len(table) for table in block_tables)
    context = max(s + n for s, n in zip(starts, lengths))
    block_ids = torch.tensor([b for table in block_tables
                              for b in table + [0] * (blocks_per_row - len(table))],
                             dtype=torch.long)
    start = torch.tensor(starts, dtype=torch.long)
    # query row j of sequence i sits at position starts[i] + j and sees keys up to itself
    query_pos = start[:, None] + torch.arange(q_len)[None, :]
    mask = torch.arange(context)[None, None, :] <= query_pos[:, :, None]  # [B, Q, L]
    mask = mask[None].expand(kv_heads, -1, -1, -1).reshape(kv_heads * batch, 1, q_len, context)
    query_index = None
    if q_len > 1 and min(lengths) < q_len:
        length = torch.tensor(lengths, dtype=torch.long)
        row = torch.arange(batch)[:, None] * q_len + torch.arange(q_len)[None, :]
        query_index = row[torch.arange(q_len)[None, :] < length[:, None]].to(device)
    shape = (kv_heads, batch * blocks_per_row, block_size, head_dim)
    return AttentionGroup(num_seqs=batch, query_len=q_len, context_len=context,
                          num_tokens=sum(lengths), block_ids=block_ids.to(device),
                          mask=mask.to(device), query_index=query_index,
                          key_buffer=torch.empty(shape, dtype=dtype, device=device),
                          value_buffer=torch.empty(shape, dtype=dtype, device=device))
