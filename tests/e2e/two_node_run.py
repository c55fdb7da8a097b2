"""Run by test_e2e_two_nodes.py in a process of its own (the suite's session Ray cluster lives in
the test process): start a two-node local Ray cluster, train 2 steps with 2 FSDP workers joined
to it through trainer.ray_address, and write what ran where as JSON.

usage: python two_node_run.py WORK_DIR PLACEMENT_STRATEGY
"""

from __future__ import annotations

import asyncio
import json
import socket
import sys
import time
from pathlib import Path

import ray
from ray.cluster_utils import Cluster
from ray.util.placement_group import placement_group_table

from tandem.config.load import load_config
from tandem.demo.tasks import make_datasets, write_jsonl
from tandem.rewards import RewardResult, register_reward
from tandem.fleet import placement
from tandem.trainer import ppo
from tandem.trainer.metrics import read_metrics
from tandem.trainer.rl_trainer import RLTrainer
from tandem.trainer.sync import fit_sync


@register_reward("two_node_parity")
def parity_reward(response_text, ground_truth, extra_info):
    """Reward variance for a random model, so the actor's gradient is not zero."""
    return RewardResult(float(len(response_text) % 2 == 0))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def config_for(directory: Path, address: str, strategy: str):
    train, val = make_datasets(directory / "data", 8, 2, seed=0)
    write_jsonl([{**json.loads(line), "data_source": "two_node_parity"}
                 for line in train.read_text().splitlines()], train)
    return load_config(overrides=[
        "model.path=tiny:qwen2", f"data.train_files=[{train}]", "data.train_batch_size=2",
        "rollout.n=2", "rollout.prompt_length=320", "rollout.response_length=8",
        "rollout.kv_cache_memory_bytes=16777216", "actor.ppo_mini_batch_size=2",
        "actor.ppo_max_token_len_per_micro_batch=2048", "actor.optim.lr=0.05",
        "trainer.n_devices=2", "actor.fsdp_size=2", "trainer.total_steps=2", "trainer.progress=false",
        f"trainer.output_dir={directory / 'run'}",
        f"trainer.ray_address={address}", f"trainer.placement_strategy={strategy}"])


async def train(config) -> dict:
    trainer = RLTrainer(config)
    await trainer.start()
    try:
        bundles = placement_group_table(trainer.fleet.placement_group)["bundles_to_node_id"]
        workers = await asyncio.gather(*(w.node_id.remote() for w in trainer.workers))
        rendezvous = await placement.rank0_rendezvous(trainer.fleet.placement_group)
        await fit_sync(trainer)
        replicas = {sid: await replica.main_server.node_id.remote()
                    for sid, replica in trainer.fleet.rollout.replicas.items()}
        status = await trainer.fleet.rollout.status()
        stats = await trainer.fleet.rollout.stats()
        # After the last update's sync: sample once more and let the sharded actor re-score it.
        trajectories = await trainer.generate(trainer.train_rows(trainer.step), trainer.step)
        batch = trainer.make_batch(trajectories)
        await trainer.compute_old_log_probs(batch)
        return {"bundle_nodes": [bundles[i] for i in range(len(bundles))], "worker_nodes": workers,
                "rendezvous": rendezvous, "replica_nodes": replicas,
                "requests": {s.server_id: s.requests for s in status.servers},
                "engine_versions": {sid: s["weight_version"] for sid, s in stats.items()},
                "final_versions": sorted({(t.min_global_steps, t.max_global_steps) for t in trajectories}),
                "final_gap": ppo.apply_rollout_correction(batch, trainer.config)}
    finally:
        await trainer.stop()


def main(directory: Path, strategy: str) -> None:
    started = time.perf_counter()
    cluster = Cluster(initialize_head=True, head_node_args={
        "gcs_server_port": free_port(), "num_cpus": 1, "resources": {"node_a": 1},
        "include_dashboard": False, "_system_config": {"worker_niceness": 0}})
    try:
        cluster.add_node(num_cpus=1, resources={"node_b": 1})
        cluster.wait_for_nodes()
        print(f"two-node cluster up in {time.perf_counter() - started:.1f} s", file=sys.stderr)
        config = config_for(directory, cluster.address, strategy)
        result = asyncio.run(train(config))
        alive = [node for node in ray.nodes() if node["Alive"]]
        result["nodes"] = {name: node["NodeID"] for node in alive
                           for name in ("node_a", "node_b") if name in node["Resources"]}
        result["node_ips"] = {node["NodeID"]: node["NodeManagerAddress"] for node in alive}
        result["records"] = read_metrics(directory / "run" / "metrics.jsonl")
        (directory / "result.json").write_text(json.dumps(result))
        print(f"trained and checked in {time.perf_counter() - started:.1f} s", file=sys.stderr)
    finally:
        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2])
