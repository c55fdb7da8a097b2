"""Answers cut at the length limit (algorithm.overlong): DAPO's soft penalty computed by hand,
truncated answers out of the loss with exactly zero gradient, nothing changed by default."""

import pytest
import torch

from tandem.algorithms import keep_untruncated, overlong_penalty
from tandem.batch.jagged import trajectories_to_batch
from tandem.batch.padding import pad_to_multiple
from tandem.batch.trajectory import Trajectory
from tandem.config.choices import ConfigError
from tandem.config.load import load_config
from tandem.trainer import ppo


def test_the_soft_penalty_by_hand():
    # limit 10, buffer 4: free up to 6 tokens, then -0.25 per token, -1 at 10 and beyond
    lengths = torch.tensor([3, 6, 7, 8, 10, 12])
    assert overlong_penalty(lengths, 10, 4).tolist() == [0.0, 0.0, -0.25, -0.5, -1.0, -1.0]
    assert overlong_penalty(lengths, 10, 4, factor=0.5).tolist() == [0.0, 0.0, -0.125, -0.25,
                                                                     -0.5, -0.5]
    assert overlong_penalty(lengths, 10, 0).tolist() == [0.0] * 6
    mask = torch.ones(3, 4)
    assert keep_untruncated(torch.tensor([False, True, False]), mask).sum(dim=1).tolist() == [4, 0, 4]


def batch_of(stop_reasons, lengths, rewards):
    trajectories = [Trajectory(prompts=torch.tensor([5, 6]), responses=torch.arange(20, 20 + n),
                               response_mask=torch.ones(n), rollout_log_probs=-torch.ones(n),
                               min_global_steps=0, max_global_steps=0, uid=f"u{i // 2}",
                               reward=reward, stop_reason=reason)
                    for i, (reason, n, reward) in enumerate(zip(stop_reasons, lengths, rewards))]
    return pad_to_multiple(trajectories_to_batch(trajectories), 6, 2)


def test_the_batch_gets_the_penalty_and_loses_the_truncated_answers():
    config = load_config(overrides=["rollout.response_length=10", "algorithm.overlong.filter=true",
                                    "algorithm.overlong.buffer_len=4"])
    batch = batch_of(["completed", "length", "completed", "completed"], [3, 10, 7, 8],
                     [1.0, 1.0, 0.0, 1.0])
    metrics = ppo.apply_overlong(batch, config)
    assert batch["reward"].tolist() == [1.0, 0.0, -0.25, 0.5, 0.0, 0.0]  # padding: untouched 0
    assert ppo.dense(batch, "loss_mask").sum(dim=1).tolist() == [3, 0, 7, 8, 0, 0]
    assert metrics == {"overlong/truncated_fraction": 0.25, "overlong/penalty_mean": -1.75 / 4}


def test_by_default_nothing_changes_but_the_share_is_reported():
    config = load_config(overrides=["rollout.response_length=10"])
    batch = batch_of(["length", "completed"], [10, 3], [1.0, 0.0])
    before = (batch["reward"].clone(), ppo.dense(batch, "loss_mask").clone())
    assert ppo.apply_overlong(batch, config) == {"overlong/truncated_fraction": 0.5}
    assert torch.equal(batch["reward"], before[0])
    assert torch.equal(ppo.dense(batch, "loss_mask"), before[1])


def test_a_truncated_answer_contributes_exactly_zero_gradient():
    from transformers import AutoModelForCausalLM

    from tandem.models.tiny import build_tiny_model
    from tandem.training.engine import TrainingEngine
    from tandem.training.losses import actor_loss_fn

    config = load_config(overrides=["rollout.response_length=10", "algorithm.overlong.filter=true",
                                    "actor.optim.lr=0.0"])
    torch.manual_seed(0)
    engine = TrainingEngine(AutoModelForCausalLM.from_pretrained(build_tiny_model()), "actor", 64,
                            optim=config.actor.optim)
    batch = batch_of(["completed", "length", "completed", "completed"], [3, 10, 4, 5],
                     [1.0, 0.0, 0.0, 1.0])
    batch["old_log_probs"] = engine.compute_log_prob(batch).field("log_probs")
    ppo.apply_overlong(batch, config)
    ppo.compute_advantages(batch, config)

    def gradient():
        engine.model.zero_grad()
        engine.accumulate_gradients(batch, actor_loss_fn(config))
        return [p.grad.clone() for p in engine.model.parameters() if p.grad is not None]

    reference = gradient()
    assert any(g.abs().sum() > 0 for g in reference)
    advantages = ppo.dense(batch, "advantages")
    advantages[1] = 100.0  # the truncated answer: whatever its advantage, no gradient
    ppo.set_dense(batch, "advantages", advantages)
    for before, after in zip(reference, gradient()):
        assert torch.equal(before, after)


def test_a_buffer_longer_than_the_limit_is_refused():
    with pytest.raises(ConfigError, match=r"algorithm\.overlong\.buffer_len: is 20, longer than "
                                          r"rollout\.response_length=10"):
        load_config(overrides=["rollout.response_length=10", "algorithm.overlong.buffer_len=20"])
