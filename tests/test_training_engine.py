"""The training engine: accumulation independent of micro-batching, a PPO step that moves the
policy the right way, a frozen reference, a critic, the lr schedule and token budgets."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from tandem.algorithms.aggregation import aggregate_loss
from tandem.algorithms.policy_loss import ppo_clip_loss
from tandem.batch.jagged import (field_lengths, field_values, make_field, padded_field, select_samples,
                                 trajectories_to_batch)
from tandem.batch.padding import pad_to_multiple
from tandem.batch.trajectory import Trajectory
from tandem.config.schema import OptimConfig
from tandem.models.tiny import TinyModelSpec, build_tiny_model
from tandem.training.critic import ValueModel
from tandem.training.engine import TrainingEngine
from tandem.training.micro_batches import split_by_token_budget, split_into
from tandem.training.optim import build_optimizer, lr_multiplier

from float_bounds import assert_within, token_logprob_bounds


def make_batch(shapes, seed=0, tool_tokens=True):
    generator = torch.Generator().manual_seed(seed)
    trajectories = []
    for p, r in shapes:
        mask = torch.ones(r, dtype=torch.long)
        if tool_tokens and r > 3:
            mask[1:3] = 0  # two tool-observation tokens inside the response
        trajectories.append(Trajectory(prompts=torch.randint(10, 500, (p,), generator=generator),
                                       responses=torch.randint(10, 500, (r,), generator=generator),
                                       response_mask=mask, rollout_log_probs=torch.zeros(r),
                                       min_global_steps=0, max_global_steps=0))
    return trajectories_to_batch(trajectories)


def with_advantages(batch, seed=1):
    lengths = field_lengths(batch["responses"])
    generator = torch.Generator().manual_seed(seed)
    batch["advantages"] = make_field(torch.randn(int(lengths.sum()), generator=generator), lengths)
    return batch


def ppo_loss_fn(mode="token-mean"):
    def loss_fn(micro_batch, outputs):
        log_probs = outputs.padded("log_probs")
        old = padded_field(micro_batch["old_log_probs"])
        mask = padded_field(micro_batch["loss_mask"])
        result = ppo_clip_loss(log_probs, old, padded_field(micro_batch["advantages"]), mask)
        loss = aggregate_loss(result.loss, mask, mode, global_token_count=outputs.mini_batch.global_tokens,
                              global_seq_count=outputs.mini_batch.global_sequences)
        return loss, {"clip_fraction": float(result.clip_fraction_upper)}
    return loss_fn


def actor(path, lr=1e-3, max_token_len=4096, **optim):
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return TrainingEngine(model, "actor", max_token_len, optim=OptimConfig(lr=lr, **optim))


@pytest.fixture(scope="module")
def tiny_path():
    return build_tiny_model(TinyModelSpec())


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_gradient_does_not_depend_on_micro_batch_size(tiny_path, mode):
    batch = with_advantages(make_batch([(5, 9), (3, 7), (8, 4), (2, 10)]))
    one_at_a_time, all_at_once = actor(tiny_path), actor(tiny_path)
    batch["old_log_probs"] = one_at_a_time.compute_log_prob(batch).field("log_probs")
    longest = int(field_lengths(batch["input_ids"]).max())
    assert len(split_by_token_budget(field_lengths(batch["input_ids"]), longest)) == 4
    # inference cut into micro-batches (first-fit reorders them) returns the batch's order
    reordered = actor(tiny_path, max_token_len=longest).compute_log_prob(batch).field("log_probs")
    # the same log-probs up to rounding: each forward within the float32 bound of the exact ones
    # (tests/float_bounds.py), so the two within twice it
    model = AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float32)
    for i in range(batch.batch_size[0]):
        _, bound = token_logprob_bounds(model, batch["prompts"][i].tolist(), batch["responses"][i].tolist())
        assert_within(reordered[i], batch["old_log_probs"][i], 2 * bound, f"sample {i}")
    one_at_a_time.accumulate_gradients(batch, ppo_loss_fn(mode), max_token_len=longest)
    all_at_once.accumulate_gradients(batch, ppo_loss_fn(mode), max_token_len=4096)
    worst = max((a.grad - b.grad).abs().max().item() for a, b in
                zip(one_at_a_time.model.parameters(), all_at_once.model.parameters()))
    assert worst < 1e-5
    assert any(p.grad.abs().max() > 1e-4 for p in all_at_once.model.parameters())  # not vacuous


def test_padding_samples_do_not_change_the_gradient(tiny_path):
    batch = make_batch([(5, 9), (3, 7), (8, 4)])
    padded = with_advantages(pad_to_multiple(batch, 4, eos_token_id=2))
    batch = with_advantages(batch)
    batch["advantages"] = select_samples(padded, [0, 1, 2])["advantages"]
    plain, with_padding = actor(tiny_path), actor(tiny_path)
    for engine, data in ((plain, batch), (with_padding, padded)):
        data["old_log_probs"] = engine.compute_log_prob(data).field("log_probs")
        engine.accumulate_gradients(data, ppo_loss_fn(), max_token_len=16)
    worst = max((a.grad - b.grad).abs().max().item() for a, b in
                zip(plain.model.parameters(), with_padding.model.parameters()))
    assert worst < 1e-6


def test_ppo_step_raises_positive_and_lowers_negative_advantage_tokens(tiny_path):
    batch = make_batch([(4, 8), (6, 5), (3, 9), (5, 6)], seed=3)
    lengths = field_lengths(batch["responses"])
    signs = torch.where(torch.arange(int(lengths.sum())) % 2 == 0, 1.0, -1.0)  # alternate +1 / -1
    batch["advantages"] = make_field(signs, lengths)
    engine = actor(tiny_path, lr=1e-3, grad_clip=10.0)
    before = engine.compute_log_prob(batch).log_probs
    batch["old_log_probs"] = make_field(before, lengths)
    metrics = engine.train_mini_batch(batch, ppo_loss_fn())
    after = engine.compute_log_prob(batch).log_probs
    mask = field_values(batch["loss_mask"]).bool()
    change = after - before
    assert (change[(signs > 0) & mask] > 0).float().mean() > 0.9
    assert (change[(signs < 0) & mask] < 0).float().mean() > 0.9
    assert change[(signs > 0) & mask].mean() > 0 > change[(signs < 0) & mask].mean()
    assert metrics["actor/grad_norm"] > 0 and metrics["actor/lr"] == pytest.approx(1e-3)
    assert metrics["actor/tokens_per_second"] > 0 and engine.global_step == 1


def test_reference_is_frozen_and_matches_the_initial_actor(tiny_path):
    batch = make_batch([(4, 8), (6, 5)])
    model = AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float32)
    reference = TrainingEngine(model, "reference", 4096)
    trained = actor(tiny_path)
    assert torch.allclose(reference.compute_log_prob(batch).log_probs, trained.compute_log_prob(batch).log_probs)
    assert not any(p.requires_grad for p in reference.model.parameters())
    with pytest.raises(ValueError, match="frozen"):
        reference.train_mini_batch(batch, ppo_loss_fn())


def test_critic_values_are_per_response_token_and_learn(tiny_path):
    batch = make_batch([(4, 8), (6, 5), (3, 9)])
    critic = TrainingEngine(ValueModel.from_pretrained(tiny_path), "critic", 4096,
                            optim=OptimConfig(lr=3e-3, grad_clip=10.0))
    values = critic.compute_values(batch)
    assert values.values.shape == (22,) and values.field("values")[1].shape == (5,)
    lengths = field_lengths(batch["responses"])
    batch["returns"] = make_field(torch.linspace(-1, 1, int(lengths.sum())), lengths)

    def value_loss(micro_batch, outputs):
        mask = padded_field(micro_batch["loss_mask"])
        error = (outputs.padded("values") - padded_field(micro_batch["returns"])) ** 2
        return aggregate_loss(error, mask, global_token_count=outputs.mini_batch.global_tokens), {}

    losses = [critic.train_mini_batch(batch, value_loss)["critic/loss"] for _ in range(6)]
    assert max(losses[-2:]) < 0.5 * losses[0]
    packed = critic.compute_values(batch).values
    critic.use_remove_padding = False
    assert (critic.compute_values(batch).values - packed).abs().max() < 1e-5


def test_lr_schedule_warmup_then_cosine():
    optim = OptimConfig(lr=1.0, warmup_steps=2, schedule="cosine", min_lr_ratio=0.1)
    values = [lr_multiplier(step, optim, total_steps=6) for step in range(7)]
    assert values[:2] == [0.5, 1.0]
    assert values[2] == pytest.approx(1.0) and values[6] == pytest.approx(0.1)
    assert values[4] == pytest.approx(0.55)
    assert all(a >= b for a, b in zip(values[1:], values[2:]))
    with pytest.raises(ValueError, match="total_steps"):
        lr_multiplier(3, optim, None)


def test_adamw_is_fused_on_plain_tensors_and_steps_like_the_reference():
    """The fused kernel (one pass per tensor; torch's CPU default goes op by op) takes the same
    steps as the reference AdamW: each step differs by rounding only, at most a few eps of the
    parameter plus a few eps of the step (lr x a bounded Adam direction)."""
    generator = torch.Generator().manual_seed(0)
    start = [torch.randn(shape, generator=generator) for shape in ((64, 32), (32,), (5, 7, 3))]
    optim = OptimConfig(lr=1e-2, weight_decay=0.1, betas=[0.9, 0.99])
    fused = [torch.nn.Parameter(t.clone()) for t in start]
    reference = [torch.nn.Parameter(t.clone()) for t in start]
    optimizer = build_optimizer(fused, optim)
    assert optimizer.defaults["fused"] is True
    expected = torch.optim.AdamW(reference, lr=1e-2, weight_decay=0.1, betas=(0.9, 0.99), foreach=False)
    steps = 3
    for _ in range(steps):
        gradients = [torch.randn(t.shape, generator=generator) for t in start]
        for params, opt in ((fused, optimizer), (reference, expected)):
            for param, gradient in zip(params, gradients):
                param.grad = gradient.clone()
            opt.step()
    eps = torch.finfo(torch.float32).eps
    for got, want, initial in zip(fused, reference, start):
        bound = steps * (4 * eps * float(want.detach().abs().max()) + 16 * eps * optim.lr / (1 - 0.9))
        assert not torch.equal(got, initial) and (got - want).abs().max() <= bound


def test_micro_batches_respect_the_token_budget():
    lengths = torch.tensor([7, 3, 9, 2, 5, 6])
    groups = split_by_token_budget(lengths, 10)
    assert sorted(torch.cat(groups).tolist()) == list(range(6))
    assert all(int(lengths[g].sum()) <= 10 for g in groups)
    assert len(groups) == 4  # 32 tokens need at least 4 bins of 10
    refined = split_into(groups, 6)
    assert len(refined) == 6 and sorted(torch.cat(refined).tolist()) == list(range(6))
    with pytest.raises(ValueError, match="ppo_max_token_len_per_micro_batch"):
        split_by_token_budget(lengths, 8)


def test_from_config_builds_each_role_and_checks_the_token_budget(tiny_path):
    from tandem.config.load import ConfigError, load_config

    config = load_config(overrides=["model.path=tiny:qwen2", "critic.enable=true"])
    batch = make_batch([(4, 8), (6, 5)])
    actor_engine = TrainingEngine.from_config(config, "actor", total_steps=10)
    reference = TrainingEngine.from_config(config, "reference")
    critic = TrainingEngine.from_config(config, "critic")
    assert actor_engine.optimizer is not None and reference.optimizer is None
    assert torch.equal(actor_engine.compute_log_prob(batch).log_probs, reference.compute_log_prob(batch).log_probs)
    assert critic.compute_values(batch).values.shape == (13,)
    with pytest.raises(ValueError, match="actor.fsdp_size"):
        TrainingEngine.from_config(load_config(overrides=["actor.fsdp_size=2"]), "actor")
    with pytest.raises(ConfigError, match="ppo_max_token_len_per_micro_batch"):
        load_config(overrides=["actor.ppo_max_token_len_per_micro_batch=100"])


def test_update_takes_one_step_per_mini_batch_and_epoch(tiny_path):
    batch = with_advantages(make_batch([(4, 3), (3, 4), (2, 2), (5, 3)]))
    engine = actor(tiny_path)
    batch["old_log_probs"] = engine.compute_log_prob(batch).field("log_probs")
    metrics = engine.update(batch, ppo_loss_fn(), mini_batch_size=2, epochs=2)
    assert engine.global_step == 4 and metrics["actor/grad_norm"] > 0
    with pytest.raises(ValueError, match="pad_to_multiple"):
        engine.update(batch, ppo_loss_fn(), mini_batch_size=3)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_ppo_step_on_cuda_with_the_trainer_loss_and_host_fields(tiny_path):
    """The trainer's batch stays on the host while the engine runs on CUDA: log-probs within the
    float32 bound of float64, micro-batches selected across devices, trainer/ppo's loss, a step
    that moves the policy the right way (three places failed on the first GPU run)."""
    from tandem.config.schema import TandemConfig
    from tandem.training.losses import actor_loss_fn

    batch = make_batch([(4, 8), (6, 5), (3, 9), (5, 6)], seed=3)
    lengths = field_lengths(batch["responses"])
    signs = torch.where(torch.arange(int(lengths.sum())) % 2 == 0, 1.0, -1.0)
    batch["advantages"] = make_field(signs, lengths)
    model = AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float32)
    engine = TrainingEngine(model, "actor", 16, optim=OptimConfig(lr=1e-3, grad_clip=10.0),
                            device="cuda")
    old = engine.compute_log_prob(batch).field("log_probs")  # on the device
    exact_model = AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float32)
    for i in range(batch.batch_size[0]):
        exact, bound = token_logprob_bounds(exact_model, batch["prompts"][i].tolist(),
                                            batch["responses"][i].tolist())
        assert_within(old[i].cpu(), exact, bound, f"sample {i}")
    batch["old_log_probs"] = old
    metrics = engine.train_mini_batch(batch, actor_loss_fn(TandemConfig()))
    change = (engine.compute_log_prob(batch).log_probs - field_values(old)).cpu()
    mask = field_values(batch["loss_mask"]).bool()
    assert metrics["actor/step_skipped"] == 0 and metrics["actor/grad_norm"] > 0
    assert change[(signs > 0) & mask].mean() > 0 > change[(signs < 0) & mask].mean()
