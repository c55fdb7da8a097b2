"""The sync-mode loop with a LoRA actor (HYBRID layout): a KL loss against the actor with its
adapters disabled (no reference model), adapter-only syncs that keep the engine on the actor,
checkpoints holding the adapter and the merged model, and `tandem eval`'s path loading either."""

import asyncio
import sys

import pytest
import ray

from tandem.trainer.rl_trainer import RLTrainer
from tandem.trainer.sync import fit_sync

from test_trainer_sync import engine_and_actor_greedy, tiny_config

pytestmark = pytest.mark.slow
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # _no_reference runs in a worker
LORA = ["actor.lora.rank=8", "actor.lora.alpha=16", "actor.use_kl_loss=true",
        "rollout.val_kwargs.do_sample=false", "rollout.val_kwargs.n=1"]


def _no_reference(worker) -> bool:
    return worker.reference is None and worker.actor.uses_lora


async def evaluate(config, resume: bool) -> dict:
    """What `tandem eval` runs (cli._eval): start, optionally load the latest checkpoint, sync,
    validate."""
    trainer = RLTrainer(config, evaluation_only=True)
    await trainer.start()
    try:
        if resume:
            assert await trainer.load_latest_checkpoint()
        await trainer.sync_weights()
        return await trainer.validate()
    finally:
        await trainer.stop()


def test_lora_sync_loop_checkpoints_and_eval(tmp_path, ray_cluster):
    config = tiny_config(tmp_path, *LORA, "actor.lora.save_merged=true", "trainer.total_steps=2",
                         "trainer.save_freq=2")

    async def run():
        trainer = RLTrainer(config)
        await trainer.start()
        try:
            assert ray.get(trainer.workers[0].__ray_call__.remote(_no_reference))
            await fit_sync(trainer)
            rows = trainer.train_rows(0)
            loop = trainer.runner.loop
            prompts = [loop.chat_format.prompt_ids(row.messages, loop.tools.schemas()) for row in rows]
            return await engine_and_actor_greedy(trainer, prompts)
        finally:
            await trainer.stop()

    for engine_tokens, actor_tokens in asyncio.run(run()):
        assert engine_tokens == actor_tokens
    from tandem.trainer.metrics import read_metrics

    steps = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if "time/generate" in r]
    assert [r["step"] for r in steps] == [1, 2] and steps[0]["actor/grad_norm"] > 0
    assert "actor/ref_kl" in steps[1] and steps[1]["actor/ref_kl"] != 0.0  # the adapter moved
    assert steps[1]["rollout_gap/abs_diff_max"] < 1e-4  # the adapter-only sync reached the engine
    actor_dir = tmp_path / "run" / "checkpoints" / "step_2" / "actor"
    assert (actor_dir / "adapter" / "adapter_config.json").exists()
    assert (actor_dir / "merged" / "config.json").exists()

    with_adapter = asyncio.run(evaluate(tiny_config(tmp_path, *LORA, "trainer.resume=true"), True))
    merged = asyncio.run(evaluate(tiny_config(tmp_path, *LORA[3:], f"model.path={actor_dir / 'merged'}"),
                                  False))
    rewards = {key: value for key, value in with_adapter.items() if key.startswith("val")}
    assert rewards and rewards == pytest.approx({k: merged[k] for k in rewards})
