"""Run by test_e2e_tensor_parallel_hosts.py on simulated host A: separate_async for 2 steps with
one TP=2 native replica spread over hosts A and B (rollout.nnodes=2, n_gpus_per_node=1: one
server per host, rank 0's the replica's address, a rank host starting rank 1 on the other), then
the replica's greedy tokens and log-probs against a fresh TP=1 engine built from the actor's
weights, and seeded sampling twice. Writes what happened as JSON.

usage: python tensor_parallel_hosts_run.py WORK_DIR RAY_ADDRESS
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import sys
from pathlib import Path

import ray
import torch
from transformers import AutoModelForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: float_bounds

from float_bounds import max_ratio, token_logprob_bounds  # noqa: E402
from two_host_run import PROMPTS, _save_actor  # noqa: E402

from tandem.config.load import load_config  # noqa: E402
from tandem.demo.tasks import make_datasets  # noqa: E402
from tandem.rollout.native import NativeRollout  # noqa: E402
from tandem.trainer.modes import fit  # noqa: E402
from tandem.trainer.rl_trainer import RLTrainer  # noqa: E402
from tandem.types import GenerateRequest  # noqa: E402

GREEDY = {"temperature": 0.0, "max_tokens": 8, "ignore_eos": True}
SEEDED = {"temperature": 1.0, "max_tokens": 8, "ignore_eos": True, "seed": 11}


def config_for(directory: Path, address: str):
    train, _ = make_datasets(directory / "data", 8, 2, seed=0)
    return load_config(overrides=[
        "model.path=tiny:qwen2", f"data.train_files=[{train}]", "data.train_batch_size=2",
        "data.val_files=[]", "rollout.n=2", "rollout.prompt_length=320",
        "rollout.response_length=8", "rollout.kv_cache_memory_bytes=16777216",
        "actor.ppo_mini_batch_size=2", "actor.ppo_max_token_len_per_micro_batch=2048",
        "actor.optim.lr=0.05", "actor.entropy_coeff=0.01",
        "trainer.trainer_mode=separate_async", "trainer.async_rollout.max_staleness=0",
        "rollout.tensor_model_parallel_size=2", "rollout.nnodes=2", "rollout.n_gpus_per_node=1",
        "trainer.total_steps=2", "trainer.progress=false",
        f"trainer.output_dir={directory / 'run'}", f"trainer.ray_address={address}"])


async def compare(trainer: RLTrainer, directory: Path) -> dict:
    """The spread replica's greedy outputs vs a fresh TP=1 engine of the actor's weights."""
    client = trainer.fleet.rollout.client()
    served = [await client.generate(GenerateRequest(f"check-{i}", prompt, GREEDY))
              for i, prompt in enumerate(PROMPTS)]
    seeded = [[(await client.generate(GenerateRequest(f"seed-{i}-{turn}", PROMPTS[0], SEEDED))
                ).token_ids for turn in range(2)] for i in range(2)]
    await trainer.workers[0].__ray_call__.remote(_save_actor, str(directory))
    one_rank = dataclasses.replace(trainer.config.rollout, tensor_model_parallel_size=1)
    fresh = NativeRollout.create(directory, one_rank)
    expected = [await fresh.generate(GenerateRequest(f"fresh-{i}", prompt, GREEDY))
                for i, prompt in enumerate(PROMPTS)]
    await fresh.shutdown()
    hf = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    ratios = []  # |TP=2 - TP=1| / (2 x the float32 bound of either): <= 1 passes
    for prompt, two, one in zip(PROMPTS, served, expected):
        _, bound = token_logprob_bounds(hf, prompt, two.token_ids)
        ratios.append(max_ratio(torch.tensor(two.log_probs), torch.tensor(one.log_probs),
                                2 * bound))
    return {"served": [o.token_ids for o in served], "fresh": [o.token_ids for o in expected],
            "served_versions": [o.global_steps for o in served], "bound_ratio": max(ratios),
            "seeded": seeded}


async def run(directory: Path, address: str) -> dict:
    trainer = RLTrainer(config_for(directory, address))
    await trainer.start()  # 2 CPUs a host: the worker fits beside either rank
    try:
        replica = next(iter(trainer.fleet.rollout.replicas.values()))
        stats = await replica.main_server.stats.remote()
        result = {"replicas": len(trainer.fleet.rollout.replicas),
                  "transport": trainer.fleet.transport,
                  "main_ip": replica.infos[0].node_ip,
                  "rank_host_ips": [info.node_ip for info in replica.rank_host_infos],
                  "rank_host_ranks": [info.ranks for info in replica.rank_host_infos],
                  "engine_ranks": stats["backend"]["tensor_parallel_ranks"]}
        await fit(trainer)
        result["step"] = trainer.step
        result["greedy"] = await compare(trainer, directory / "actor")
        return result
    finally:
        await trainer.stop()


if __name__ == "__main__":
    work = Path(sys.argv[1])
    outcome = asyncio.run(run(work, sys.argv[2]))
    (work / "result.json").write_text(json.dumps(outcome))
