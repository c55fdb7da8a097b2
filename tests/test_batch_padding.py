"""Sample padding: no-op samples up to a multiple, zeros everywhere that feeds a loss."""

import pytest
import torch

from tandem.batch.jagged import field_lengths, make_field, non_tensor_list, trajectories_to_batch
from tandem.batch.padding import PADDING_UID, drop_padding_samples, pad_to_multiple
from tandem.batch.trajectory import Trajectory

EOS = 2


def batch_of(sizes, reward=1.0):
    return trajectories_to_batch([
        Trajectory(prompts=torch.arange(1, p + 1), responses=torch.arange(10, 10 + r),
                   response_mask=torch.ones(r, dtype=torch.long), rollout_log_probs=torch.full((r,), -0.5),
                   min_global_steps=5, max_global_steps=6, uid=f"u{i}", reward=reward)
        for i, (p, r) in enumerate(sizes)])


def test_pads_to_multiple_with_noop_samples():
    batch = batch_of([(3, 4), (2, 5), (4, 1)])
    padded = pad_to_multiple(batch, multiple=4, eos_token_id=EOS)
    assert padded.batch_size[0] == 4
    pad = padded[3]
    assert pad["prompts"].tolist() == [EOS] and pad["responses"].tolist() == [EOS]
    assert pad["input_ids"].tolist() == [EOS, EOS]
    assert pad["response_mask"].tolist() == [0] and pad["loss_mask"].tolist() == [0]
    assert pad["rollout_log_probs"].tolist() == [0.0] and float(pad["reward"]) == 0.0
    assert padded["is_padding"].tolist() == [False, False, False, True]
    assert non_tensor_list(padded, "uid")[3] == PADDING_UID
    for i in range(3):  # the real samples are untouched
        assert torch.equal(padded["input_ids"][i], batch["input_ids"][i])


def test_noop_when_divisible_and_drop_padding_restores():
    batch = batch_of([(3, 4), (2, 5)])
    assert pad_to_multiple(batch, 2, EOS) is batch
    padded = pad_to_multiple(batch, 8, EOS)
    assert padded.batch_size[0] == 8 and int(padded["is_padding"].sum()) == 6
    back = drop_padding_samples(padded)
    assert non_tensor_list(back, "uid") == ["u0", "u1"]
    assert torch.equal(back["responses"][1], batch["responses"][1])


def test_extra_fields_are_padded_with_zeros():
    batch = batch_of([(3, 4), (2, 5), (4, 1)])
    lengths = field_lengths(batch["responses"])
    batch["advantages"] = make_field(torch.ones(int(lengths.sum())), lengths)
    batch["score"] = torch.ones(3)
    padded = pad_to_multiple(batch, 5, EOS)
    assert padded["advantages"][4].tolist() == [0.0] and padded["score"].tolist() == [1, 1, 1, 0, 0]
    with pytest.raises(ValueError, match="multiple"):
        pad_to_multiple(batch, 0, EOS)
