"""The trainer's PPO glue: padding samples and tool tokens get exactly zero gradient."""

import torch

from tandem.batch.jagged import trajectories_to_batch
from tandem.batch.padding import pad_to_multiple
from tandem.batch.trajectory import Trajectory
from tandem.config.load import load_config
from tandem.trainer import ppo
from tandem.training.engine import TrainingEngine
from tandem.training.losses import actor_loss_fn


def make_batch(eos: int) -> torch.Tensor:
    def trajectory(uid, prompt, response, mask, reward):
        return Trajectory(prompts=torch.tensor(prompt), responses=torch.tensor(response),
                          response_mask=torch.tensor(mask, dtype=torch.float32),
                          rollout_log_probs=-torch.rand(len(response)) * torch.tensor(mask, dtype=torch.float32),
                          min_global_steps=0, max_global_steps=0, uid=uid, reward=reward)
    trajectories = [trajectory("a", [5, 6, 7], [21, 22, 31, 32, 23], [1, 1, 0, 0, 1], 1.0),
                    trajectory("a", [5, 6, 7], [24, 25, 26], [1, 1, 1], 0.0),
                    trajectory("b", [8, 9], [27, 33, 34, 28], [1, 0, 0, 1], 1.0),
                    trajectory("b", [8, 9], [29], [1], 0.0)]
    return pad_to_multiple(trajectories_to_batch(trajectories), 6, eos)


def actor_gradient(engine, batch, config):
    engine.model.zero_grad()
    engine.accumulate_gradients(batch, actor_loss_fn(config), calculate_entropy=True)
    return {name: p.grad.clone() for name, p in engine.model.named_parameters() if p.grad is not None}


def test_padding_and_tool_tokens_get_zero_gradient():
    from transformers import AutoModelForCausalLM

    from tandem.models.tiny import build_tiny_model

    config = load_config(overrides=["actor.entropy_coeff=0.01", "actor.use_kl_loss=true",
                                    "actor.optim.lr=0.0"])
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(build_tiny_model())
    engine = TrainingEngine(model, "actor", max_token_len=64, optim=config.actor.optim)
    batch = make_batch(model.config.eos_token_id)
    assert int(batch["is_padding"].sum()) == 2
    log_probs = engine.compute_log_prob(batch).field("log_probs")
    batch["old_log_probs"] = log_probs
    batch["ref_log_prob"] = log_probs
    ppo.apply_rollout_correction(batch, config)
    ppo.compute_advantages(batch, config)
    reference = actor_gradient(engine, batch, config)
    assert any(g.abs().sum() > 0 for g in reference.values())

    # Scramble everything the loss reads at tool tokens and in padding samples.
    mask = ppo.dense(batch, "loss_mask") > 0
    for key in ("old_log_probs", "ref_log_prob", "advantages", "rollout_log_probs"):
        values = ppo.dense(batch, key)
        noise = torch.randn_like(values) * 5
        ppo.set_dense(batch, key, torch.where(mask, values, noise))
    scrambled = actor_gradient(engine, batch, config)
    for name, gradient in reference.items():
        assert torch.equal(gradient, scrambled[name]), name
