"""The batch's other layouts (seed §7.3-§7.5; docs/batches.md): packed (remove padding: every valid
token in one row [1, T], positions restarting at 0 per sequence, `cu_seqlens`), dense (prompts
left-padded to [B, P], responses right-padded to [B, R]), their exact inverses, shared prompts (each
prompt once before its responses, with the `AttentionRows` that let each response see it), and the
next-token-shifted response slice of full-sequence outputs."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Sequence

import torch
from tensordict import TensorDict

from tandem.batch.jagged import field_lengths, field_offsets, field_values, make_field, ragged_ranges

RESPONSE_ALIGNED = ("response_mask", "loss_mask", "rollout_log_probs")


def response_positions(sequence_ends: torch.Tensor, response_lengths: torch.Tensor) -> torch.Tensor:
    """Flat indices [sum R_i] of the outputs that predict each response token: a sequence ending
    (exclusive) at flat index `end` with R response tokens has them at end-R-1 .. end-2."""
    response_lengths = response_lengths.long()
    return ragged_ranges(sequence_ends.long() - response_lengths - 1, response_lengths)


def response_from_nested(full: torch.Tensor, response_lengths: torch.Tensor) -> torch.Tensor:
    """Per-token outputs of whole sequences [B, P_i+R_i] -> their response part [B, R_i].

    Slices full[end-R-1 : end-1] of each sequence (next-token shift); jagged or stacked in and out.
    """
    response_lengths = torch.as_tensor(response_lengths, dtype=torch.long)
    lengths = field_lengths(full)
    if response_lengths.shape != lengths.shape:
        raise ValueError(f"response_from_nested: {lengths.numel()} sequences but "
                         f"{response_lengths.numel()} response lengths")
    if bool((response_lengths >= lengths).any()):
        raise ValueError("response_from_nested: every sequence needs at least one prompt token "
                         "before its response (response_lengths must be < sequence lengths)")
    positions = response_positions(field_offsets(full)[1:], response_lengths)
    return make_field(field_values(full)[positions], response_lengths)


@dataclass
class PackedBatch:
    """Remove-padding layout: all valid tokens in one row, sequence i at [cu_seqlens[i], cu_seqlens[i+1])."""

    input_ids: torch.Tensor  # [1, T]
    position_ids: torch.Tensor  # [1, T], 0 at the first token of each sequence
    cu_seqlens: torch.Tensor  # [B+1] int32
    max_seqlen: int
    prompt_lengths: torch.Tensor  # [B]
    response_lengths: torch.Tensor  # [B]
    response_fields: dict[str, torch.Tensor] = field(default_factory=dict)  # each [sum R_i]

    def response_positions(self) -> torch.Tensor:
        """Indices into the packed row [sum R_i] of the outputs predicting each response token."""
        return response_positions(self.cu_seqlens[1:], self.response_lengths)


def to_packed(batch: TensorDict, response_fields: tuple[str, ...] = RESPONSE_ALIGNED) -> PackedBatch:
    """Jagged batch -> PackedBatch; `response_fields` present in the batch are packed along."""
    lengths = field_lengths(batch["input_ids"])
    cu_seqlens = torch.zeros(lengths.numel() + 1, dtype=torch.int32)
    cu_seqlens[1:] = lengths.cumsum(0)
    return PackedBatch(
        input_ids=field_values(batch["input_ids"])[None],
        position_ids=field_values(batch["position_ids"])[None],
        cu_seqlens=cu_seqlens,
        max_seqlen=int(lengths.max()),
        prompt_lengths=field_lengths(batch["prompts"]),
        response_lengths=field_lengths(batch["responses"]),
        response_fields={name: field_values(batch[name]) for name in response_fields if name in batch.keys()},
    )


def from_packed(packed: PackedBatch) -> TensorDict:
    """PackedBatch -> the token fields of the jagged batch (prompts, responses, input_ids, ...)."""
    starts = packed.cu_seqlens[:-1].long()
    ids = packed.input_ids[0]
    fields = {
        "input_ids": make_field(ids, packed.prompt_lengths + packed.response_lengths),
        "position_ids": make_field(packed.position_ids[0], packed.prompt_lengths + packed.response_lengths),
        "prompts": make_field(ids[ragged_ranges(starts, packed.prompt_lengths)], packed.prompt_lengths),
        "responses": make_field(ids[ragged_ranges(starts + packed.prompt_lengths, packed.response_lengths)],
                                packed.response_lengths),
    }
    for name, values in packed.response_fields.items():
        fields[name] = make_field(values, packed.response_lengths)
    return TensorDict(fields, batch_size=[packed.prompt_lengths.numel()])


@dataclass
class DenseBatch:
    """Padded layout: prompts left-padded, responses right-padded; input_ids = [prompts | responses]."""

    prompts: torch.Tensor  # [B, P]
    responses: torch.Tensor  # [B, R]
    input_ids: torch.Tensor  # [B, P+R]
    attention_mask: torch.Tensor  # [B, P+R], 1 on real tokens
    position_ids: torch.Tensor  # [B, P+R], 0 on padding
    response_fields: dict[str, torch.Tensor] = field(default_factory=dict)  # each [B, R], 0 on padding

    @property
    def prompt_width(self) -> int:
        """P: the column where every response starts."""
        return self.prompts.shape[1]

    def response_attention(self) -> torch.Tensor:
        """[B, R] bool: which response columns hold a real token."""
        return self.attention_mask[:, self.prompt_width:].bool()


def _valid_mask(lengths: torch.Tensor, width: int, left: bool) -> torch.Tensor:
    columns = torch.arange(width)[None]
    if left:
        return columns >= (width - lengths)[:, None]
    return columns < lengths[:, None]


def _scatter(values: torch.Tensor, mask: torch.Tensor, pad_value: float) -> torch.Tensor:
    out = torch.full(mask.shape, pad_value, dtype=values.dtype)
    out[mask] = values  # boolean assignment fills row-major: each row's tokens in order
    return out


def to_dense(batch: TensorDict, pad_token_id: int,
             response_fields: tuple[str, ...] = RESPONSE_ALIGNED) -> DenseBatch:
    """Jagged batch -> DenseBatch (prompts left-padded with pad_token_id, responses right-padded)."""
    prompt_lengths = field_lengths(batch["prompts"])
    response_lengths = field_lengths(batch["responses"])
    prompt_mask = _valid_mask(prompt_lengths, int(prompt_lengths.max()), left=True)
    response_mask = _valid_mask(response_lengths, int(response_lengths.max()), left=False)
    attention = torch.cat([prompt_mask, response_mask], dim=1)
    prompts = _scatter(field_values(batch["prompts"]), prompt_mask, pad_token_id)
    responses = _scatter(field_values(batch["responses"]), response_mask, pad_token_id)
    return DenseBatch(
        prompts=prompts,
        responses=responses,
        input_ids=torch.cat([prompts, responses], dim=1),
        attention_mask=attention.long(),
        position_ids=_scatter(field_values(batch["position_ids"]), attention, 0),
        response_fields={name: _scatter(field_values(batch[name]), response_mask, 0)
                         for name in response_fields if name in batch.keys()},
    )


def from_dense(dense: DenseBatch) -> TensorDict:
    """DenseBatch -> the token fields of the jagged batch; lengths come from attention_mask."""
    width = dense.prompt_width
    attention = dense.attention_mask.bool()
    prompt_lengths = attention[:, :width].sum(1)
    response_lengths = attention[:, width:].sum(1)
    fields = {
        "prompts": make_field(dense.prompts[attention[:, :width]], prompt_lengths),
        "responses": make_field(dense.responses[attention[:, width:]], response_lengths),
        "input_ids": make_field(dense.input_ids[attention], prompt_lengths + response_lengths),
        "position_ids": make_field(dense.position_ids[attention], prompt_lengths + response_lengths),
    }
    for name, values in dense.response_fields.items():
        fields[name] = make_field(values[attention[:, width:]], response_lengths)
    return TensorDict(fields, batch_size=[dense.prompts.shape[0]])


@dataclass
class AttentionRows:
    """A packed row laid out again as `count` right-padded rows of `width` slots, for attention.

    gather [count * width]: the packed token in each slot (padding slots take token 0: right
    padding is never attended by a valid query); scatter [T]: the slot whose output each packed
    token takes. Attention over the rows (causal) is attention within each sequence.
    """

    gather: torch.Tensor
    scatter: torch.Tensor
    count: int
    width: int

    def to(self, device: torch.device) -> "AttentionRows":
        """The same rows with their index tensors on `device`."""
        return AttentionRows(self.gather.to(device), self.scatter.to(device), self.count, self.width)


@dataclass
class SharedPromptBatch:
    """Packed layout in which samples with the same prompt share one copy of it.

    Each prompt group is [prompt | response_1 | ... | response_k] in one row [1, T], every
    response positioned right after the prompt (positions P .. P+R-1), so the decoder computes
    the prompt once per group instead of once per sample. `rows` lets attention see, for each
    sample, its group's prompt followed by its own response. Forward outputs differ from the
    plain packed layout only by float rounding; prompt gradients add up over the group.
    """

    input_ids: torch.Tensor  # [1, T]
    position_ids: torch.Tensor  # [1, T]
    rows: AttentionRows  # one row per sample, in prompt-group order
    response_index: torch.Tensor  # [sum R_i] in batch order: the outputs predicting each response token


def prompt_groups(batch: TensorDict) -> torch.Tensor:
    """[B] int64: for each sample, the index of the first sample with the same prompt tokens."""
    prompts, starts = field_values(batch["prompts"]), field_offsets(batch["prompts"]).tolist()
    first: dict[bytes, int] = {}
    return torch.tensor([first.setdefault(prompts[start:end].numpy().tobytes(), i)
                         for i, (start, end) in enumerate(zip(starts, starts[1:]))], dtype=torch.long)


def group_members(groups: Sequence[int], indices: Iterable[int] | None = None) -> list[list[int]]:
    """The indices (all of `groups`, or `indices`) gathered by group id, groups in order of
    first appearance: [[members of the first group], ...]."""
    members: dict[int, list[int]] = {}
    for i in range(len(groups)) if indices is None else indices:
        members.setdefault(groups[i], []).append(i)
    return list(members.values())


def to_shared_prompts(batch: TensorDict) -> SharedPromptBatch | None:
    """Jagged batch -> SharedPromptBatch, or None when no two samples share a prompt or the
    positions are not 0 .. L-1 per sample (then the plain packed layout does the same work)."""
    prompt_lengths = field_lengths(batch["prompts"]).tolist()
    response_lengths = field_lengths(batch["responses"]).tolist()
    lengths = field_lengths(batch["input_ids"])
    standard_positions = field_values(batch["position_ids"]).eq(
        ragged_ranges(torch.zeros_like(lengths), lengths)).all()
    if min(prompt_lengths, default=0) < 1 or not bool(standard_positions):
        return None
    prompts, responses = field_values(batch["prompts"]), field_values(batch["responses"])
    prompt_starts = field_offsets(batch["prompts"]).tolist()
    response_starts = field_offsets(batch["responses"]).tolist()
    groups = group_members(prompt_groups(batch).tolist())
    if len(groups) == len(prompt_lengths):
        return None
    width = int(lengths.max())
    ids, positions, gather, scatter, index = [], [], [], [], [None] * len(prompt_lengths)
    cursor = 0
    for members in groups:
        owner, length = members[0], prompt_lengths[members[0]]
        prompt_at = cursor
        ids.append(prompts[prompt_starts[owner]:prompt_starts[owner] + length])
        positions.append(torch.arange(length))
        scatter.append(len(gather) * width + torch.arange(length))  # the owner's row computes it
        cursor += length
        for member in members:
            count = response_lengths[member]
            ids.append(responses[response_starts[member]:response_starts[member] + count])
            positions.append(torch.arange(length, length + count))
            row = torch.zeros(width, dtype=torch.long)
            row[:length] = torch.arange(prompt_at, prompt_at + length)
            row[length:length + count] = torch.arange(cursor, cursor + count)
            scatter.append(len(gather) * width + length + torch.arange(count))
            gather.append(row)
            # the prompt's last token predicts the first response token, each response token the next
            index[member] = torch.cat([torch.tensor([prompt_at + length - 1]),
                                       torch.arange(cursor, cursor + max(count - 1, 0))])[:count]
            cursor += count
    return SharedPromptBatch(
        input_ids=torch.cat(ids)[None], position_ids=torch.cat(positions)[None],
        rows=AttentionRows(torch.cat(gather), torch.cat(scatter), len(gather), width),
        response_index=torch.cat(index))


def attention_rows(cu_seqlens: torch.Tensor) -> AttentionRows:
    """The rows of a plain packed row: sequence s in row s (`cu_seqlens` [B+1] boundaries)."""
    lengths = cu_seqlens.diff().long()
    starts = cu_seqlens[:-1].long()
    count, width, total = lengths.numel(), int(lengths.max()), int(cu_seqlens[-1])
    sequence = torch.repeat_interleave(torch.arange(count), lengths, output_size=total)
    scatter = sequence * width + torch.arange(total) - starts[sequence]
    gather = torch.zeros(count * width, dtype=torch.long).index_copy(0, scatter, torch.arange(total))
    return AttentionRows(gather, scatter, count, width)
