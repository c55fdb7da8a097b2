"""Checkpoints resume exactly and their weights are an HF model directory."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from tandem.batch.jagged import field_lengths, make_field, padded_field, trajectories_to_batch
from tandem.batch.trajectory import Trajectory
from tandem.config.schema import OptimConfig
from tandem.models.tiny import TinyModelSpec, build_tiny_model
from tandem.training.critic import ValueModel
from tandem.training.engine import TrainingEngine


def make_batch(seed):
    generator = torch.Generator().manual_seed(seed)
    return trajectories_to_batch([
        Trajectory(prompts=torch.randint(10, 500, (p,), generator=generator),
                   responses=torch.randint(10, 500, (r,), generator=generator),
                   response_mask=torch.ones(r, dtype=torch.long), rollout_log_probs=torch.zeros(r),
                   min_global_steps=0, max_global_steps=0) for p, r in ((4, 6), (3, 8))])


def loss_fn(micro_batch, outputs):
    # a reinforce-style loss with noise drawn from the global RNG, so RNG state matters on resume
    log_probs = outputs.padded("log_probs")
    weights = torch.randn(log_probs.shape)
    mask = padded_field(micro_batch["loss_mask"])
    return -(log_probs * weights * mask).sum() / outputs.mini_batch.global_tokens, {}


def new_engine(path):
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    optim = OptimConfig(lr=1e-3, warmup_steps=2, schedule="cosine", min_lr_ratio=0.1, weight_decay=0.01)
    return TrainingEngine(model, "actor", 4096, optim=optim, total_steps=6)


@pytest.fixture(scope="module")
def tiny_path():
    return build_tiny_model(TinyModelSpec())


def test_resume_is_exact(tiny_path, tmp_path):
    torch.manual_seed(0)
    engine = new_engine(tiny_path)
    for step in range(2):
        engine.train_mini_batch(make_batch(step), loss_fn)
    engine.save_checkpoint(tmp_path / "step2", extra={"data_cursor": 2})
    for step in range(2, 4):
        last = engine.train_mini_batch(make_batch(step), loss_fn)
    expected = {name: p.detach().clone() for name, p in engine.model.named_parameters()}

    torch.manual_seed(123)  # a different RNG state, overwritten by the checkpoint's
    resumed = new_engine(tiny_path)
    assert resumed.load_checkpoint(tmp_path / "step2") == {"data_cursor": 2}
    assert resumed.global_step == 2
    for step in range(2, 4):
        again = resumed.train_mini_batch(make_batch(step), loss_fn)
    for name, parameter in resumed.model.named_parameters():
        assert torch.equal(parameter, expected[name]), name
    assert again["actor/lr"] == last["actor/lr"] and again["actor/grad_norm"] == last["actor/grad_norm"]


def test_checkpoint_weights_load_as_an_hf_model(tiny_path, tmp_path):
    engine = new_engine(tiny_path)
    engine.train_mini_batch(make_batch(0), loss_fn)
    engine.save_checkpoint(tmp_path)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    for name, parameter in engine.model.named_parameters():
        assert torch.equal(reloaded.get_parameter(name), parameter), name


def test_critic_checkpoint_round_trip(tiny_path, tmp_path):
    critic = TrainingEngine(ValueModel.from_pretrained(tiny_path, seed=1), "critic", 4096, optim=OptimConfig())
    critic.save_checkpoint(tmp_path)
    other = TrainingEngine(ValueModel.from_pretrained(tiny_path, seed=2), "critic", 4096, optim=OptimConfig())
    batch = make_batch(0)
    assert not torch.equal(other.compute_values(batch).values, critic.compute_values(batch).values)
    other.load_checkpoint(tmp_path)
    assert torch.equal(other.compute_values(batch).values, critic.compute_values(batch).values)


def test_loading_a_missing_checkpoint_names_the_fix(tiny_path, tmp_path):
    with pytest.raises(FileNotFoundError, match="trainer.resume"):
        new_engine(tiny_path).load_checkpoint(tmp_path / "nothing")
