"""Run by test_e2e_two_hosts.py on simulated host A (the Ray head's namespaces): for each trainer
mode, train 2 steps with the actor on host A and a standalone native server on host B, synced
with no transport configured (auto); then check the server's greedy tokens against a fresh
engine built from the actor's weights; finally kill host B's server in the middle of a sync.
Writes what happened as JSON.

usage: python two_host_run.py WORK_DIR RAY_ADDRESS HOST_B_IP

Which host the training worker lands on is Ray's choice (both hosts have one CPU); to make it
host A, a placeholder actor holds host B's CPU until the workers are placed.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path

import ray

from tandem.config.load import load_config
from tandem.demo.tasks import make_datasets
from tandem.rollout.native import NativeRollout
from tandem.fleet import placement
from tandem.trainer.modes import fit
from tandem.trainer.rl_trainer import RLTrainer
from tandem.types import GenerateRequest
from tandem.weight_sync.base import WeightSyncError

GREEDY = {"temperature": 0.0, "max_tokens": 8, "ignore_eos": True}
PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [12, 13]]
SYNC_TIMEOUT_S = 10.0


def config_for(directory: Path, address: str, mode: str):
    train, _ = make_datasets(directory / "data", 8, 2, seed=0)
    return load_config(overrides=[
        "model.path=tiny:qwen2", f"data.train_files=[{train}]", "data.train_batch_size=2",
        "rollout.n=2", "rollout.prompt_length=320", "rollout.response_length=8",
        "rollout.kv_cache_memory_bytes=16777216", "actor.ppo_mini_batch_size=2",
        "actor.ppo_max_token_len_per_micro_batch=2048", "actor.optim.lr=0.05",
        "actor.entropy_coeff=0.01",  # a gradient even when a group's rewards tie
        f"trainer.trainer_mode={mode}", "rollout.nnodes=1", "rollout.n_gpus_per_node=1",
        "trainer.total_steps=2", "trainer.progress=false",
        f"rollout.checkpoint_engine.timeout_s={SYNC_TIMEOUT_S}",
        # several buckets, so the server holds part of the stream when it is killed
        "rollout.checkpoint_engine.update_weights_bucket_megabytes=1",
        f"trainer.output_dir={directory / mode}", f"trainer.ray_address={address}"])


def _save_actor(worker, directory: str) -> None:
    worker.actor.model.save_pretrained(directory)


def _slow_stream(worker, delay_s: float) -> None:
    export = type(worker.actor).export_weights

    def slow():
        for item in export(worker.actor):
            time.sleep(delay_s)
            yield item

    worker.actor.export_weights = slow


async def greedy_pair(trainer: RLTrainer, directory: Path) -> dict:
    """The standalone server's greedy tokens and a fresh engine's, built from the actor."""
    client = trainer.fleet.rollout.client()
    served = [await client.generate(GenerateRequest(f"check-{i}", prompt, GREEDY))
              for i, prompt in enumerate(PROMPTS)]
    await trainer.workers[0].__ray_call__.remote(_save_actor, str(directory))
    fresh = NativeRollout.create(directory, trainer.config.rollout)
    expected = [await fresh.generate(GenerateRequest(f"fresh-{i}", prompt, GREEDY))
                for i, prompt in enumerate(PROMPTS)]
    await fresh.shutdown()
    return {"served": [o.token_ids for o in served], "fresh": [o.token_ids for o in expected],
            "served_versions": [o.global_steps for o in served]}


async def kill_mid_sync(trainer: RLTrainer) -> dict:
    """Kill host B's server while a sync streams into it; the error and how long it took."""
    replica = next(iter(trainer.fleet.rollout.replicas.values()))
    server = replica.main_server
    # ~5 s for the stream, each wait well within the deadline
    await trainer.workers[0].__ray_call__.remote(_slow_stream, 0.2)
    started = time.monotonic()
    sync = asyncio.create_task(trainer.fleet.weight_sync.sync(trainer.step + 1))
    deadline = time.monotonic() + 120
    while (await server.stats.remote())["sync"] is None:  # the server has joined the sync
        if time.monotonic() > deadline:
            raise RuntimeError("host B's server never started receiving")
        await asyncio.sleep(0.05)
    await asyncio.sleep(1.0)  # the stream is moving
    ray.kill(server)
    killed_at = time.monotonic() - started
    try:
        await sync
    except WeightSyncError as error:
        return {"phase": error.phase, "peer": error.peer, "message": str(error),
                "killed_at_s": killed_at, "elapsed_s": time.monotonic() - started}
    return {"phase": None, "killed_at_s": killed_at, "elapsed_s": time.monotonic() - started}


@ray.remote(num_cpus=1)
class Placeholder:
    def ready(self) -> bool:
        return True


async def start_with_workers_on_a(trainer: RLTrainer, host_b_ip: str) -> None:
    """trainer.start() while host B's CPU is held, released once the workers are placed (the
    standalone server's placement group then waits for it, and gets host B)."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    placement.init_ray(trainer.config)
    node_b = next(n["NodeID"] for n in ray.nodes() if n["NodeManagerAddress"] == host_b_ip)
    holder = Placeholder.options(scheduling_strategy=NodeAffinitySchedulingStrategy(
        node_b, soft=False)).remote()
    await holder.ready.remote()
    start = asyncio.create_task(trainer.start())
    while "workers" not in trainer.startup.marks and not start.done():
        await asyncio.sleep(0.05)
    ray.kill(holder)
    await start


async def run_mode(directory: Path, address: str, host_b_ip: str, mode: str, kill: bool) -> dict:
    trainer = RLTrainer(config_for(directory, address, mode))
    await start_with_workers_on_a(trainer, host_b_ip)
    try:
        replica = next(iter(trainer.fleet.rollout.replicas.values()))
        result = {"transport": trainer.fleet.transport,
                  "worker_ip": await trainer.workers[0].__ray_call__.remote(
                      lambda worker: ray.util.get_node_ip_address()),
                  "server_ip": replica.infos[0].node_ip}
        await fit(trainer)
        result["step"] = trainer.step
        result["greedy"] = await greedy_pair(trainer, directory / f"{mode}-actor")
        if kill:
            result["kill"] = await kill_mid_sync(trainer)
        return result
    finally:
        await trainer.stop()


def main(directory: Path, address: str, host_b_ip: str) -> None:
    results = {}
    for mode in ("sync", "colocate_async", "separate_async"):
        started = time.perf_counter()
        results[mode] = asyncio.run(run_mode(directory, address, host_b_ip, mode,
                                             kill=mode == "separate_async"))
        print(f"{mode}: {time.perf_counter() - started:.1f} s", file=sys.stderr, flush=True)
        ray.shutdown()
    (directory / "result.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2], sys.argv[3])
