"""Sample padding: append no-op samples so the batch divides by the data-parallel size and the
mini-batch size (their least common multiple, seed §7.6).

This is padding of the sample count, not of token lengths (seed §7.6). A padding sample is
prompt [eos], response [eos], every mask 0, rollout_log_probs [0.0], reward 0, is_padding True.
"""

from __future__ import annotations

import math

import torch
from tensordict import TensorDict

from tandem.batch.jagged import (IMAGE_FIELDS, NON_TENSOR_FIELDS, concat_batches, field_lengths, make_field,
                                 select_samples, trajectories_to_batch)
from tandem.batch.trajectory import Trajectory

PADDING_UID = "__padding__"  # one shared uid: GRPO sees one group of identical zero scores


def padding_trajectory(eos_token_id: int, weight_version: int = 0, with_reward: bool = True) -> Trajectory:
    """One no-op sample: [eos] prompt and response, masks 0, logprob 0.0, reward 0."""
    eos = torch.tensor([eos_token_id], dtype=torch.long)
    return Trajectory(prompts=eos.clone(), responses=eos.clone(),
                      response_mask=torch.zeros(1, dtype=torch.long),
                      rollout_log_probs=torch.zeros(1, dtype=torch.float32),
                      min_global_steps=weight_version, max_global_steps=weight_version,
                      uid=PADDING_UID, reward=0.0 if with_reward else None, is_padding=True)


def pad_to_multiple(batch: TensorDict, multiple: int, eos_token_id: int) -> TensorDict:
    """Append padding samples until the sample count divides by `multiple`. Fields computed after
    batching are padded with zeros: [B] scalars, response-aligned fields with one 0, whole-sequence
    fields with two."""
    if multiple < 1:
        raise ValueError(f"pad_to_multiple: multiple={multiple} must be >= 1 "
                         "(lcm of the data-parallel size and the mini-batch size)")
    size = batch.batch_size[0]
    missing = -size % multiple
    if missing == 0:
        return batch
    version = int(batch["max_global_steps"].max())
    padding = trajectories_to_batch([padding_trajectory(eos_token_id, version, "reward" in batch.keys())
                                     for _ in range(missing)])
    response_lengths = field_lengths(batch["responses"])
    sequence_lengths = field_lengths(batch["input_ids"])
    for key in set(batch.keys()) - set(padding.keys()):
        field = batch.get(key)
        if not isinstance(field, torch.Tensor):
            raise ValueError(f"pad_to_multiple: cannot pad the non-tensor field {key!r}; add it after "
                             f"padding or list it in batch.jagged.NON_TENSOR_FIELDS {NON_TENSOR_FIELDS}")
        if not field.is_nested and field.dim() == 1:
            padding[key] = torch.zeros(missing, dtype=field.dtype)
            continue
        lengths = field_lengths(field)
        if key in ("kept_token_ids", *IMAGE_FIELDS):
            width = 0  # a padding sample has no kept set (kept_counts 0) and no image
        elif torch.equal(lengths, response_lengths):
            width = 1
        elif torch.equal(lengths, sequence_lengths):
            width = 2
        else:
            raise ValueError(f"pad_to_multiple: field {key!r} is neither response-aligned nor "
                             "whole-sequence; pad the batch before adding it")
        padding[key] = make_field(torch.zeros(missing * width, *field.shape[2:], dtype=field.dtype),
                                  torch.full((missing,), width, dtype=torch.long))
    return concat_batches([batch, padding])


def pad_for_data_parallel(batch: TensorDict, dp_size: int, mini_batch_size: int,
                          eos_token_id: int) -> TensorDict:
    """Pad to a multiple of lcm(dp_size, mini_batch_size) trajectories: every rank gets an equal
    shard and every optimizer step a full mini-batch, with the fewest padding samples."""
    if dp_size < 1 or mini_batch_size < 1:
        raise ValueError(f"pad_for_data_parallel: dp_size={dp_size} and mini_batch_size="
                         f"{mini_batch_size} must both be >= 1")
    return pad_to_multiple(batch, math.lcm(dp_size, mini_batch_size), eos_token_id)


def drop_padding_samples(batch: TensorDict) -> TensorDict:
    """The batch without its is_padding samples (e.g. before computing metrics per sample)."""
    keep = ~batch["is_padding"]
    if bool(keep.all()):
        return batch
    return select_samples(batch, keep)
