"""Strictly on-policy updates take old_log_probs from their own forward: same values, same
gradients and same step as a separate compute_log_prob pass, one forward fewer."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from tandem.batch.jagged import field_values
from tandem.config.load import load_config
from tandem.config.schema import OptimConfig
from tandem.models.tiny import TinyModelSpec, build_tiny_model
from tandem.trainer import ppo
from tandem.training.engine import TrainingEngine

from test_training_engine import make_batch, ppo_loss_fn, with_advantages

EPS = torch.finfo(torch.float32).eps
HIDDEN = TinyModelSpec().hidden_size
# Both passes run the same kernels on the same inputs; only grad mode differs. Should a kernel
# still differ in summation order, each dot product of length <= HIDDEN errs by at most
# HIDDEN * eps relative (Higham's bound), per layer (2) plus the LM head: 3 * HIDDEN * eps ~ 2.3e-5.
RELATIVE = 3 * HIDDEN * EPS


@pytest.fixture(scope="module")
def tiny_path():
    return build_tiny_model(TinyModelSpec())


def engine(path, max_token_len=4096):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return TrainingEngine(model, "actor", max_token_len, optim=OptimConfig(lr=1e-3))


def close(a, b):
    scale = max(float(a.abs().max()), float(b.abs().max()), 1.0)
    return float((a - b).abs().max()) <= RELATIVE * scale


@pytest.mark.parametrize("max_token_len", [4096, 16])  # one micro-batch, and several
def test_on_policy_update_equals_separate_pass(tiny_path, max_token_len):
    batch = with_advantages(make_batch([(5, 9), (3, 7), (8, 4), (2, 10)]))
    separate, shortcut = engine(tiny_path, max_token_len), engine(tiny_path, max_token_len)
    calls = {"forward": 0}
    shortcut.model.get_decoder().register_forward_pre_hook(lambda *_: calls.__setitem__("forward", calls["forward"] + 1))

    old = separate.compute_log_prob(batch, calculate_entropy=True)
    with_old = batch.clone()
    with_old["old_log_probs"] = old.field("log_probs")
    separate.accumulate_gradients(with_old, ppo_loss_fn())
    groups = []
    shortcut.accumulate_gradients(batch, ppo_loss_fn(), on_policy=groups)
    # one forward per micro-batch, none for old_log_probs
    assert calls["forward"] == len(shortcut._micro_batches(batch, None)) == len(groups)
    assert "old_log_probs" not in batch.keys()  # micro-batch copies got them, the caller's batch not
    gradients = [(a.grad, b.grad) for a, b in zip(separate.model.parameters(), shortcut.model.parameters())]
    assert all(close(a, b) for a, b in gradients)
    assert any(float(a.abs().max()) > 1e-3 for a, _ in gradients)  # not vacuous

    fresh = engine(tiny_path, max_token_len)
    reference = fresh.compute_log_prob(batch, calculate_entropy=True)
    expected = fresh.update(with_old, ppo_loss_fn(), mini_batch_size=4)
    stepped = engine(tiny_path, max_token_len)
    before = [p.detach().clone() for p in stepped.model.parameters()]
    metrics, returned = stepped.update_on_policy(batch, ppo_loss_fn())
    assert stepped.global_step == 1
    assert any(not torch.equal(a, b) for a, b in zip(before, stepped.model.parameters()))
    assert close(returned.log_probs, reference.log_probs) and close(returned.entropy, reference.entropy)
    assert returned.log_probs.shape == field_values(batch["responses"]).shape
    assert not returned.log_probs.requires_grad
    assert metrics["actor/clip_fraction"] == 0.0  # ratio exactly 1: nothing clipped
    assert abs(metrics["actor/grad_norm"] - expected["actor/grad_norm"]) <= RELATIVE * expected["actor/grad_norm"]
    assert metrics["actor/step_skipped"] == 0.0


def test_on_policy_refuses_a_batch_that_has_old_log_probs(tiny_path):
    batch = with_advantages(make_batch([(4, 3), (3, 4)]))
    actor = engine(tiny_path)
    batch["old_log_probs"] = actor.compute_log_prob(batch).field("log_probs")
    with pytest.raises(ValueError, match="call update"):
        actor.update_on_policy(batch, ppo_loss_fn())


@pytest.mark.parametrize("overrides, expected", [
    ([], True),
    (["actor.ppo_epochs=2"], False),
    (["data.train_batch_size=16"], False),  # two mini-batches of 8 prompts
    (["algorithm.use_kl_in_reward=true"], False),
    (["algorithm.rollout_correction.importance_sampling=token"], False),
    (["algorithm.rollout_correction.rejection=token"], False),
    (["actor.use_kl_loss=true"], True),  # the reference is a separate model: still on-policy
])
def test_which_configs_take_old_log_probs_from_the_update(overrides, expected):
    config = load_config(overrides=["data.train_batch_size=8", "actor.ppo_mini_batch_size=8", *overrides])
    assert ppo.old_log_probs_from_update(config) is expected


def test_sync_loop_on_policy_skips_the_old_log_prob_pass(tmp_path, ray_cluster):
    import asyncio

    from tandem.trainer.metrics import read_metrics
    from tandem.trainer.rl_trainer import RLTrainer
    from tandem.trainer.sync import fit_sync
    from test_trainer_sync import tiny_config

    config = tiny_config(tmp_path, "actor.ppo_mini_batch_size=2", "trainer.total_steps=2", "trainer.save_freq=2")
    assert ppo.old_log_probs_from_update(config)
    called = []

    async def run():
        trainer = RLTrainer(config)
        per_worker = trainer._per_worker

        async def recording(method, *args):
            called.append(method)
            return await per_worker(method, *args)

        trainer._per_worker = recording
        await trainer.start()
        try:
            await fit_sync(trainer)
        finally:
            await trainer.stop()

    asyncio.run(run())
    assert called == ["update_actor_on_policy"] * 2
    steps = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if "time/generate" in r]
    assert [r["step"] for r in steps] == [1, 2]
    # step 2 sampled from the synced weights: the actor's own old log-probs match the engine's
    assert steps[1]["rollout_gap/abs_diff_max"] < 1e-4 and steps[0]["actor/grad_norm"] > 0
    assert steps[0]["actor/policy/clip_fraction_upper"] == 0.0
    assert "actor/entropy" in steps[0]
    # the last checkpoint's actor directory is a loadable HF model with its tokenizer
    from transformers import AutoTokenizer

    final = tmp_path / "run" / "checkpoints" / "step_2" / "actor"
    assert AutoTokenizer.from_pretrained(final).eos_token_id is not None
    AutoModelForCausalLM.from_pretrained(final)
