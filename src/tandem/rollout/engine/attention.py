"""Attention over the paged KV cache, for a step that mixes prompt chunks and decode tokens.

The step's tokens are flat, group after group (`model_runner.attention_buckets`; decode tokens form
one group). Each layer first writes the new keys/values into their cache slots (`write_kv`, or the
fused CPU kernel `rotary_write_kv`). Then per group: `DecodeGroup` (CPU fp32 with the fused
kernels): one kernel call reads each sequence's blocks in place; `AttentionGroup`: the group's
blocks are gathered into a buffer every layer of the step reuses and one batched SDPA runs;
`CascadeGroup` (decode on the torch path): shared prefixes are read once per family.

Cache layout per layer: [kv_heads, num_blocks, block_size, head_dim]. Gathering a group's block
tables along dim 1 gives [kv_heads, B, context, head_dim] contiguous, so each (kv head, sequence)
pair is one attention "batch" entry whose query heads are the G = heads / kv_heads heads sharing
that kv head: no repeat of K/V for grouped-query attention.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

# SDPA backends on CUDA. cuDNN's attention (torch's first choice on Hopper for a masked call)
# builds a graph for every new shape, and a decode step's context grows by one token each step:
# on the first GPU run that was 1.4 ms of host time per call, most of a 0.5B model's step.
NO_CUDNN = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


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
class SuffixBucket:
    """Rows [start, end) of a cascade group (similar suffix lengths) and their suffix blocks.
    block_ids: [rows * blocks] (pad 0); mask: [kv_heads * rows, 1, context] additive."""

    start: int
    end: int
    context: int
    block_ids: torch.Tensor
    mask: torch.Tensor
    keys: torch.Tensor
    values: torch.Tensor


@dataclass
class CascadeGroup:
    """Decoding sequences (one new token each) where families of them share prefix blocks,
    e.g. the n samples of one prompt. Attention is split: each family's queries attend to its
    shared prefix once (the prefix K/V is read once, not n times), each sequence attends to
    its own suffix (rows sorted by suffix length, in buckets), and the two partial softmaxes
    are merged with their running maxima and sums.

    prefix_block_ids: [F * prefix_blocks]; prefix_mask: [kv_heads * F, 1, Lp] additive;
    prefix_rows: [F * family_size] rows of each family (B = a zero row for padding);
    row_slot: [B] each row's index in the family layout (F * family_size = "no shared prefix").
    """

    num_seqs: int
    num_families: int
    family_size: int
    prefix_context: int
    suffixes: list[SuffixBucket]
    prefix_block_ids: torch.Tensor
    prefix_mask: torch.Tensor
    prefix_rows: torch.Tensor
    row_slot: torch.Tensor
    prefix_keys: torch.Tensor
    prefix_values: torch.Tensor

    @property
    def num_tokens(self) -> int:
        return self.num_seqs


@dataclass
class DecodeGroup:
    """Decoding sequences (one new token each) for the fused CPU kernel.
    block_tables: [B, blocks_per_row] (padded with block 0); context_lens: [B] tokens attended."""

    block_tables: torch.Tensor
    context_lens: torch.Tensor

    @property
    def num_tokens(self) -> int:
        return self.context_lens.shape[0]


@dataclass
class AttentionMetadata:
    slots: torch.Tensor  # [T] cache slot (block * block_size + offset) of every new token
    groups: list[AttentionGroup | CascadeGroup | DecodeGroup]  # in the order of the flat tokens


def write_kv(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
             value_cache: torch.Tensor, slots: torch.Tensor) -> None:
    """key/value [T, KVH, D] into caches [KVH, num_blocks, block_size, D] at `slots`."""
    kv_heads, _, _, head_dim = key_cache.shape
    key_cache.view(kv_heads, -1, head_dim).index_copy_(1, slots, key.transpose(0, 1))
    value_cache.view(kv_heads, -1, head_dim).index_copy_(1, slots, value.transpose(0, 1))


def paged_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """query [T, H, D] of the step's tokens -> output [T, H * D]. The step's keys and values
    must already be in the cache."""
    with sdpa_kernel(NO_CUDNN) if query.is_cuda else nullcontext():
        return _paged_attention(query, key_cache, value_cache, meta, scale)


def _paged_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                     meta: AttentionMetadata, scale: float) -> torch.Tensor:
    kv_heads, _, block_size, head_dim = key_cache.shape
    groups_per_kv = query.shape[1] // kv_heads
    outputs = []
    offset = 0
    for group in meta.groups:
        q = query[offset:offset + group.num_tokens]
        offset += group.num_tokens
        if isinstance(group, CascadeGroup):
            outputs.append(cascade_attention(q, key_cache, value_cache, group, scale))
            continue
        if isinstance(group, DecodeGroup):
            out = torch.empty_like(q)
            torch.ops.tandem_cpu.decode_attention(out, q.contiguous(), key_cache, value_cache,
                                                  group.block_tables, group.context_lens, scale)
            outputs.append(out.view(group.num_tokens, -1))
            continue
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


def _partial_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                       mask: torch.Tensor, scale: float):
    """q [N, R, D], keys/values [N, L, D], additive mask [N, 1, L] -> unnormalised output
    [N, R, D], row max [N, R, 1] and row sum of exp [N, R, 1] of a softmax over L."""
    scores = torch.baddbmm(mask, q, keys.transpose(1, 2), alpha=scale)
    row_max = scores.amax(dim=-1, keepdim=True)
    weights = scores.sub_(row_max).exp_()
    return torch.bmm(weights, values), row_max, weights.sum(dim=-1, keepdim=True)


def cascade_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                      group: CascadeGroup, scale: float) -> torch.Tensor:
    """query [B, H, D] (one token per sequence) -> [B, H * D]."""
    kv_heads, _, _, head_dim = key_cache.shape
    batch, families, size = group.num_seqs, group.num_families, group.family_size
    rows = query.shape[1] // kv_heads
    q = query.view(batch, kv_heads, rows, head_dim).transpose(0, 1)  # [KVH, B, G, D]
    parts = []
    for bucket in group.suffixes:
        count = bucket.end - bucket.start
        torch.index_select(key_cache, 1, bucket.block_ids, out=bucket.keys)
        torch.index_select(value_cache, 1, bucket.block_ids, out=bucket.values)
        keys = bucket.keys.view(kv_heads * count, -1, head_dim)[:, :bucket.context]
        values = bucket.values.view(kv_heads * count, -1, head_dim)[:, :bucket.context]
        bucket_q = q[:, bucket.start:bucket.end].reshape(kv_heads * count, rows, head_dim)
        parts.append([part.view(kv_heads, count, rows, -1) for part in
                      _partial_attention(bucket_q, keys, values, bucket.mask, scale)])
    out, row_max, row_sum = (torch.cat(part, dim=1).view(kv_heads * batch, rows, -1)
                             if len(parts) > 1 else part[0].view(kv_heads * batch, rows, -1)
                             for part in zip(*parts))
    torch.index_select(key_cache, 1, group.prefix_block_ids, out=group.prefix_keys)
    torch.index_select(value_cache, 1, group.prefix_block_ids, out=group.prefix_values)
    keys = group.prefix_keys.view(kv_heads * families, -1, head_dim)[:, :group.prefix_context]
    values = group.prefix_values.view(kv_heads * families, -1, head_dim)[:, :group.prefix_context]
    padded = torch.cat([q, q.new_zeros(kv_heads, 1, rows, head_dim)], dim=1)
    family_q = padded.index_select(1, group.prefix_rows).view(kv_heads * families, size * rows,
                                                              head_dim)
    prefix = _partial_attention(family_q, keys, values, group.prefix_mask, scale)
    # back to one entry per (kv head, sequence); the extra slot means "no shared prefix"
    empty = (q.new_zeros(kv_heads, 1, rows, head_dim),
             q.new_full((kv_heads, 1, rows, 1), -torch.inf), q.new_zeros(kv_heads, 1, rows, 1))
    prefix_out, prefix_max, prefix_sum = (
        torch.cat([part.view(kv_heads, families * size, rows, -1), pad], dim=1)
        .index_select(1, group.row_slot).view(kv_heads * batch, rows, -1)
        for part, pad in zip(prefix, empty))
    top = torch.maximum(row_max, prefix_max)
    own, shared = (row_max - top).exp_(), (prefix_max - top).exp_()
    out = (out * own + prefix_out * shared) / (row_sum * own + prefix_sum * shared)
    return out.view(kv_heads, batch, rows * head_dim).transpose(0, 1).reshape(batch, -1)


def build_cascade_group(tables: list[list[int]], contexts: list[int], shared: list[int],
                        families: list[list[int]], block_size: int, kv_heads: int,
                        head_dim: int, dtype: torch.dtype, device: torch.device) -> CascadeGroup:
    """Row i has context contexts[i] in blocks tables[i], of which the first shared[i] blocks
    are its family's prefix (0: none); families lists the rows of each family. Rows must come
    sorted by suffix length, longest first: suffixes within 1.5x share one bucket."""
    batch = len(tables)
    suffix_lengths = [context - blocks * block_size for context, blocks in zip(contexts, shared)]
    prefix_blocks = max(shared[members[0]] for members in families)
    size = max(len(members) for members in families)
    prefix_rows, row_slot = [], [len(families) * size] * batch
    for f, members in enumerate(families):
        for j, row in enumerate(members):
            row_slot[row] = f * size + j
        prefix_rows += members + [batch] * (size - len(members))

    def flat(tables: list[list[int]], width: int) -> torch.Tensor:
        return padded_block_tables(tables, width, device).view(-1)

    def additive_mask(lengths: list[int], width: int) -> torch.Tensor:
        valid = torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]
        mask = torch.zeros(len(lengths), width, dtype=dtype).masked_fill_(~valid, -torch.inf)
        return mask[None].expand(kv_heads, -1, -1).reshape(-1, 1, width).to(device)

    def buffer(blocks: int) -> torch.Tensor:
        return torch.empty(kv_heads, blocks, block_size, head_dim, dtype=dtype, device=device)

    suffixes, start = [], 0
    while start < batch:
        end = start + 1
        while end < batch and suffix_lengths[end] * 1.5 >= suffix_lengths[start]:
            end += 1
        rows = range(start, end)
        suffix_tables = [tables[row][shared[row]:] for row in rows]
        blocks = max(len(table) for table in suffix_tables)
        suffixes.append(SuffixBucket(
            start=start, end=end, context=suffix_lengths[start],
            block_ids=flat(suffix_tables, blocks),
            mask=additive_mask(suffix_lengths[start:end], suffix_lengths[start]),
            keys=buffer(len(rows) * blocks), values=buffer(len(rows) * blocks)))
        start = end
    prefix_lengths = [shared[members[0]] * block_size for members in families]
    return CascadeGroup(
        num_seqs=batch, num_families=len(families), family_size=size,
        prefix_context=prefix_blocks * block_size, suffixes=suffixes,
        prefix_block_ids=flat([tables[m[0]][:shared[m[0]]] for m in families], prefix_blocks),
        prefix_mask=additive_mask(prefix_lengths, prefix_blocks * block_size),
        prefix_rows=torch.tensor(prefix_rows, dtype=torch.long, device=device),
        row_slot=torch.tensor(row_slot, dtype=torch.long, device=device),
        prefix_keys=buffer(len(families) * prefix_blocks),
        prefix_values=buffer(len(families) * prefix_blocks))


def build_group(starts: list[int], lengths: list[int], block_tables: list[list[int]],
                block_size: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                device: torch.device) -> AttentionGroup:
    """Metadata of one group: sequence i computes tokens [starts[i], starts[i] + lengths[i])."""
    batch = len(starts)
    q_len = max(lengths)
    blocks_per_row = max(len(table) for table in block_tables)
    context = max(s + n for s, n in zip(starts, lengths))
    block_ids = padded_block_tables(block_tables, blocks_per_row, device).view(-1)
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
                          num_tokens=sum(lengths), block_ids=block_ids,
                          mask=mask.to(device), query_index=query_index,
                          key_buffer=torch.empty(shape, dtype=dtype, device=device),
                          value_buffer=torch.empty(shape, dtype=dtype, device=device))


def build_decode_group(tables: list[list[int]], contexts: list[int],
                       device: torch.device) -> DecodeGroup:
    """Metadata of a decode group: row i attends to the first contexts[i] tokens of tables[i]."""
    width = max(len(table) for table in tables)
    return DecodeGroup(block_tables=padded_block_tables(tables, width, device),
                       context_lens=torch.tensor(contexts, dtype=torch.long, device=device))


def padded_block_tables(tables: list[list[int]], width: int,
                        device: torch.device) -> torch.Tensor:
    """[len(tables), width] block ids, each table padded with block 0 (a valid block whose
    padding positions every reader masks or skips)."""
    return torch.tensor([table + [0] * (width - len(table)) for table in tables],
                        dtype=torch.long, device=device)
