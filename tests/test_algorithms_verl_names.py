"""verl's algorithm names through the config: accepted names, clear errors, and the trainer wiring."""

import pytest
import torch
from tensordict import TensorDict

from tandem.batch.jagged import field_lengths, make_field, trajectories_to_batch
from tandem.batch.trajectory import Trajectory
from tandem.config import ConfigError, load_config
from tandem.config.choices import KL_TYPES, LOSS_AGG_MODES
from tandem.trainer import ppo
from tandem.training.forward import ForwardOutput, MiniBatchInfo
from tandem.training.losses import actor_loss_fn


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_every_loss_agg_mode_loads(mode):
    assert load_config(overrides=[f"actor.loss_agg_mode={mode}"]).actor.loss_agg_mode == mode


@pytest.mark.parametrize("kind", KL_TYPES)
def test_every_kl_name_loads_for_the_loss_and_the_reward(kind):
    config = load_config(overrides=[f"actor.kl_loss_type={kind}", f"algorithm.kl_penalty={kind}"])
    assert config.actor.kl_loss_type == config.algorithm.kl_penalty == kind


@pytest.mark.parametrize("overrides, field, words", [
    (["actor.kl_loss_type=k4"], "actor.kl_loss_type", "valid values are k1, kl, abs, k2, mse, k3, "
                                                      "low_var_kl, k1+, kl+, abs+, k2+, mse+, k3+, low_var_kl+"),
    (["algorithm.kl_penalty=full"], "algorithm.kl_penalty", "whole vocabulary"),
    (["actor.loss_agg_mode=token_sum"], "actor.loss_agg_mode", "token-sum"),
    (["actor.loss_scale_factor=0"], "actor.loss_scale_factor", "positive"),
    (["algorithm.rollout_correction.importance_sampling=geometric"],
     "algorithm.rollout_correction.importance_sampling", "none, token, sequence"),
    (["algorithm.rollout_correction.importance_sampling_mode=mask"],
     "algorithm.rollout_correction.importance_sampling_mode", "truncate, icepop"),
    (["algorithm.rollout_correction.importance_sampling_mode=icepop",
      "algorithm.rollout_correction.importance_sampling_low=3.0"],
     "algorithm.rollout_correction.importance_sampling_low", "<= importance_sampling_threshold"),
    (["algorithm.rollout_correction.rejection=seq_max_k1"], "algorithm.rollout_correction.rejection",
     "seq_mean_k1"),
    (["algorithm.rollout_correction.rejection=token_k2"], "algorithm.rollout_correction.rejection",
     "rejection_threshold"),
    (["algorithm.rollout_correction.rejection=token_k1,seq_sum_k3",
      "algorithm.rollout_correction.rejection_threshold='0.5_2.0,1_2'"],
     "algorithm.rollout_correction.rejection", "one positive upper bound"),
])
def test_bad_names_give_an_error_naming_field_and_choices(overrides, field, words):
    with pytest.raises(ConfigError) as error:
        load_config(overrides=overrides)
    assert field in str(error.value) and words in str(error.value)


def test_verl_rejection_settings_load_as_verl_writes_them():
    config = load_config(overrides=["algorithm.rollout_correction.rejection=token_k1,seq_max_k3",
                                    "algorithm.rollout_correction.rejection_threshold='0.5_2.0,0.01'"])
    assert config.algorithm.rollout_correction.rejection_threshold == "0.5_2.0,0.01"
    # a bare number (YAML float) is accepted too, as verl's rollout_rs_threshold is
    config = load_config(overrides=["algorithm.rollout_correction.rejection=seq_mean_k3",
                                    "algorithm.rollout_correction.rejection_threshold=0.05"])
    assert config.algorithm.rollout_correction.rejection_threshold == "0.05"


@pytest.mark.parametrize("scale_factor, divisor", [(None, 16), (4, 4)])
def test_actor_loss_divides_sum_norm_by_loss_scale_factor(scale_factor, divisor):
    overrides = ["actor.loss_agg_mode=seq-mean-token-sum-norm", "rollout.response_length=16"]
    if scale_factor is not None:
        overrides.append(f"actor.loss_scale_factor={scale_factor}")
    loss_fn = actor_loss_fn(load_config(overrides=overrides))
    old = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -0.7, -1.1]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    advantages = torch.tensor([[1.0, 2.0, 50.0], [-1.0, 0.5, 3.0]])
    batch = TensorDict({"loss_mask": mask, "old_log_probs": old, "advantages": advantages}, batch_size=[2])
    outputs = ForwardOutput(response_lengths=torch.tensor([3, 3]), log_probs=old.flatten(),
                            mini_batch=MiniBatchInfo(global_tokens=5.0, global_sequences=2, dp_size=1))
    loss, _ = loss_fn(batch, outputs)
    # ratio 1: per-token loss -A; summed over the 5 masked-in tokens, divided by the constant
    # and by the mini-batch's 2 non-empty rows (current verl; verl < 0.8 had no row mean)
    assert float(loss) == pytest.approx(-(1.0 + 2.0 - 1.0 + 0.5 + 3.0) / divisor / 2)


def test_trainer_applies_verl_rejection_and_icepop_weights_to_a_jagged_batch():
    rollout = [torch.log(torch.tensor([0.5, 0.5, 0.9, 0.5])), torch.log(torch.tensor([0.4, 0.4]))]
    ratios = [torch.tensor([3.0, 1.0, 1.0, 1.2]), torch.tensor([1.0, 1.5])]  # pi_old / pi_rollout
    masks = [torch.tensor([1.0, 1.0, 0.0, 1.0]), torch.tensor([1.0, 1.0])]  # token 3 of row 0: a tool token
    trajectories = [Trajectory(prompts=torch.tensor([5, 6]), responses=torch.arange(len(m)) + 20,
                               response_mask=m, rollout_log_probs=r * m, min_global_steps=0,
                               max_global_steps=0, uid=str(i), reward=1.0)
                    for i, (r, m) in enumerate(zip(rollout, masks))]
    batch = trajectories_to_batch(trajectories)
    batch["old_log_probs"] = make_field(torch.cat([(r + q.log()) * m for r, q, m in zip(rollout, ratios, masks)]),
                                        field_lengths(batch["responses"]))
    config = load_config(overrides=[
        "algorithm.rollout_correction.rejection=token_k2", "algorithm.rollout_correction.rejection_threshold=0.5",
        "algorithm.rollout_correction.importance_sampling=token",
        "algorithm.rollout_correction.importance_sampling_mode=icepop",
        "algorithm.rollout_correction.importance_sampling_threshold=1.4"])
    metrics = ppo.apply_rollout_correction(batch, config)
    # k2 of ratio 3 is 0.60 > 0.5: rejected; the tool token stays out of the loss
    # (the dense view is cut to the longest response: padded_field may pad wider)
    assert ppo.dense(batch, "loss_mask")[:, :4].tolist() == [[0.0, 1.0, 0.0, 1.0], [1.0, 1.0, 0.0, 0.0]]
    # icepop in [0.5, 1.4]: 3 and 1.5 are zeroed, 1.2 kept as is
    torch.testing.assert_close(ppo.dense(batch, "importance_weights")[:, :4],
                               torch.tensor([[0.0, 1.0, 0.0, 1.2], [1.0, 0.0, 0.0, 0.0]]))
    assert metrics["rollout_correction/token_k2/rejected_token_fraction"] == pytest.approx(1 / 5)
    assert metrics["rollout_correction/zeroed_fraction"] == pytest.approx(1 / 4)  # of the 4 kept tokens
