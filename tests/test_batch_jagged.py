"""The jagged batch: the seed's worked example, the stacked/jagged rule, selection and concat."""

import pytest
import torch

from tandem.batch.jagged import (batch_to_trajectories, concat_batches, field_lengths, field_values,
                                 make_field, non_tensor_list, padded_field, select_samples,
                                 trajectories_to_batch)
from tandem.batch.trajectory import Trajectory


def make_trajectory(prompt, response, mask, logprobs, uid="u", reward=None, **extra):
    return Trajectory(prompts=torch.tensor(prompt), responses=torch.tensor(response),
                      response_mask=torch.tensor(mask), rollout_log_probs=torch.tensor(logprobs),
                      min_global_steps=3, max_global_steps=4, uid=uid, reward=reward, **extra)


def test_seed_worked_example_fields_and_shapes():
    a, b, c = -0.5, -1.25, -0.125
    batch = trajectories_to_batch([make_trajectory([11, 12, 13], [21, 22, 31, 32, 23], [1, 1, 0, 0, 1],
                                                   [a, b, 0.0, 0.0, c], num_turns=2)])
    sample = batch[0]
    assert sample["prompts"].tolist() == [11, 12, 13]
    assert sample["responses"].tolist() == [21, 22, 31, 32, 23]
    assert sample["input_ids"].tolist() == [11, 12, 13, 21, 22, 31, 32, 23]
    assert sample["position_ids"].tolist() == list(range(8))
    assert sample["response_mask"].tolist() == [1, 1, 0, 0, 1]
    assert sample["loss_mask"].tolist() == [1, 1, 0, 0, 1]
    assert sample["rollout_log_probs"].tolist() == [a, b, 0.0, 0.0, c]
    assert batch["prompts"].shape == (1, 3) and batch["input_ids"].shape == (1, 8)
    assert batch["responses"].shape == (1, 5) and batch["rollout_log_probs"].shape == (1, 5)
    assert batch["num_turns"].tolist() == [2] and batch["is_padding"].tolist() == [False]
    assert batch["min_global_steps"].tolist() == [3] and batch["max_global_steps"].tolist() == [4]


def test_jagged_where_lengths_differ_stacked_where_equal():
    batch = trajectories_to_batch([
        make_trajectory([1, 2], [3, 4, 5], [1, 1, 1], [-1.0, -2.0, -3.0], uid="a", reward=1.0),
        make_trajectory([6, 7], [8], [1], [-4.0], uid="b", reward=0.0),
    ])
    assert not batch["prompts"].is_nested and batch["prompts"].shape == (2, 2)
    assert batch["responses"].is_nested and batch["input_ids"].is_nested
    assert field_lengths(batch["responses"]).tolist() == [3, 1]
    assert field_values(batch["input_ids"]).tolist() == [1, 2, 3, 4, 5, 6, 7, 8]
    assert batch["reward"].tolist() == [1.0, 0.0]
    assert non_tensor_list(batch, "uid") == ["a", "b"]
    assert batch["input_ids"].dtype == torch.long and batch["rollout_log_probs"].dtype == torch.float32


def test_partial_rewards_are_an_error():
    with pytest.raises(ValueError, match="no reward"):
        trajectories_to_batch([make_trajectory([1], [2], [1], [-1.0], reward=1.0),
                               make_trajectory([1], [2], [1], [-1.0])])


def test_select_and_concat_keep_every_value():
    trajectories = [make_trajectory([1] * (i + 1), list(range(i + 2)), [1] * (i + 2), [-0.5] * (i + 2),
                                    uid=f"u{i}", reward=float(i), ground_truth={"x": i},
                                    metadata={"turns": i}) for i in range(4)]
    batch = trajectories_to_batch(trajectories)
    picked = select_samples(batch, torch.tensor([3, 1]))
    assert non_tensor_list(picked, "uid") == ["u3", "u1"]
    assert picked["responses"][0].tolist() == [0, 1, 2, 3, 4]
    assert non_tensor_list(picked, "ground_truth") == [{"x": 3}, {"x": 1}]
    same_length = select_samples(batch, torch.tensor([2]))
    assert not same_length["responses"].is_nested
    rebuilt = concat_batches([select_samples(batch, torch.tensor([0, 1])), select_samples(batch, [2, 3])])
    for original, back in zip(trajectories, batch_to_trajectories(rebuilt)):
        assert torch.equal(original.input_ids, back.input_ids)
        assert torch.equal(original.rollout_log_probs, back.rollout_log_probs)
        assert (original.uid, original.reward, original.ground_truth, original.metadata) == \
            (back.uid, back.reward, back.ground_truth, back.metadata)


def test_padded_field_pads_to_the_longest_sample_and_keeps_gradients():
    """[B, max L_i], not [B, sum L_i] (jagged to_padded_tensor's default), gradients flow back."""
    values = torch.arange(10.0, requires_grad=True)
    field = make_field(values, torch.tensor([4, 3, 2, 1]))
    padded = padded_field(field, pad_value=-1.0)
    assert padded.shape == (4, 4)
    assert padded[3].tolist() == [9.0, -1.0, -1.0, -1.0]
    padded.clamp(min=0).sum().backward()
    assert values.grad.tolist() == [1.0] * 10
