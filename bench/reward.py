"""Served reward model: step time with the reward model scored after sampling (serial) vs
overlapped with generation (the reward worker, reward.placement=agent_loop).

Real box: the sync trainer on the tiny policy with a heavier tiny reward model on a core of its
own (reward.model.n_devices=1), long-tailed response lengths (bench/modes.py's client), both
placements on the same task in one process. Also the box's CPU-busy fraction over each run
(/proc/stat): overlap needs idle cores to move the reward into. Simulated clock (no model): the
same comparison at GPU scale on bench/modes_sim.py's generation model, with a reward pool of
its own scoring each finished group (FIFO) while generation goes on.

    PYTHONPATH=src:bench .venv/bin/python bench/reward.py
Last line: RATIO <overlapped / serial step time> (simulated GPU clock) ...
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import ray

from modes import LongTailClient, step_seconds
from modes_sim import Rollout, Workload
from tandem.config.load import load_config
from tandem.demo.tasks import make_datasets
from tandem.models.tiny import build_tiny_reward_model
from tandem.trainer.metrics import read_metrics
from tandem.fleet.placement import without_token_auth_notice
from tandem.trainer.rl_trainer import RLTrainer
from tandem.trainer.sync import fit_sync

PLACEMENTS = {"serial": "after_sampling", "overlapped": "agent_loop"}


def cpu_times() -> tuple[float, float]:
    """(busy, total) jiffies of all cores since boot."""
    fields = [float(v) for v in Path("/proc/stat").read_text().split("\n")[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return sum(fields) - idle, sum(fields)


async def run_placement(name: str, args: argparse.Namespace, train: Path, reward_path: Path,
                        directory: Path) -> dict[str, float]:
    """Train args.steps sync steps with the reward model placed as `name`; per-step means."""
    config = load_config(overrides=[
        "model.path=tiny:qwen2", f"data.train_files=[{train}]", "data.val_files=[]",
        f"data.train_batch_size={args.batch}", f"rollout.n={args.n}", "rollout.prompt_length=320",
        f"rollout.response_length={args.long}", "rollout.kv_cache_memory_bytes=33554432",
        "rollout.multi_turn.enable=false", f"actor.ppo_mini_batch_size={args.batch}",
        "actor.ppo_max_token_len_per_micro_batch=4096", f"trainer.total_steps={args.steps}",
        "trainer.progress=false", f"trainer.output_dir={directory / name}",
        "reward.rule_weight=0", "reward.model.enable=true", f"reward.model.path={reward_path}",
        f"reward.placement={PLACEMENTS[name]}"])
    trainer = RLTrainer(config)
    await trainer.start()
    trainer.runner.loop.client = LongTailClient(trainer.runner.loop.client, args.short, args.long,
                                                args.long_fraction)
    busy0, total0 = cpu_times()
    try:
        await fit_sync(trainer)
    finally:
        await trainer.stop()
    busy1, total1 = cpu_times()
    records = [r for r in read_metrics(directory / name / "metrics.jsonl") if "time/update" in r]
    measured = records[1:] or records
    mean = lambda key: sum(r.get(key, 0.0) for r in measured) / len(measured)  # noqa: E731
    step = sum(step_seconds({k: v for k, v in r.items() if k != "time/reward_overlapped"})
               for r in measured) / len(measured)
    return {"step_s": step, "generate_s": mean("time/generate"), "reward_s": mean("time/reward"),
            "overlapped_s": mean("time/reward_overlapped"),
            "cpu_busy": (busy1 - busy0) / max(total1 - total0, 1.0)}


@dataclass
class RewardClock:
    """A reward model on a pool of its own: seconds per scored token (prompt + response)."""

    # a reward model twice the policy's size (a 14B RM for modes_sim's 7B policy): its forward
    # is 2 x a third of the policy's fwd + bwd per token (Workload.train_s_per_token)
    s_per_token: float = 2 * 3.5e-4 / 3
    devices: int = 2


def simulate(work: Workload, rollout_devices: int, reward: RewardClock, steps: int,
             seed: int) -> tuple[float, float, float]:
    """(serial step s, overlapped step s, reward share of the serial step) of sync steps:
    generate -> [reward] -> train -> sync; overlapped, each finished group is scored FIFO on the
    reward pool while generation goes on, and the step waits only for the last group's score."""
    rng = random.Random(seed)
    batch = work.groups_per_device * rollout_devices
    serial = overlapped = share = 0.0
    for _ in range(steps):
        rollout = Rollout(work, rollout_devices * work.slots, batch, rng)
        rollout.fill(0)
        finishes = []  # (generation time a group finished, its tokens)
        while rollout.running:
            done = len(rollout.finished)
            rollout.run(rollout.next_finish() - rollout.G)
            finishes += [(rollout.G, g.tokens + work.n * work.prompt_tokens)
                         for g in rollout.finished[done:]]
        generate = rollout.G
        tokens = sum(t for _, t in finishes)
        score = lambda t: t * reward.s_per_token / reward.devices  # noqa: E731
        reward_done = 0.0
        for finished, group_tokens in finishes:  # one scorer queue, groups in finish order
            reward_done = max(reward_done, finished) + score(group_tokens)
        rest = work.train_s(tokens, rollout_devices) + work.sync_s(hybrid=True)
        serial_step = generate + score(tokens) + rest
        serial += serial_step
        overlapped += max(generate, reward_done) + rest
        share += score(tokens) / serial_step
    return serial / steps, overlapped / steps, share / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--batch", type=int, default=4, help="prompts per step")
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--short", type=int, default=16)
    parser.add_argument("--long", type=int, default=96)
    parser.add_argument("--long-fraction", type=float, default=0.2)
    parser.add_argument("--rm-hidden", type=int, default=384, help="the tiny reward model's width")
    parser.add_argument("--rm-layers", type=int, default=8)
    parser.add_argument("--sim-only", action="store_true")
    parser.add_argument("--sim-devices", type=int, default=16)
    args = parser.parse_args()
    print(f"load average {os.getloadavg()}, {os.cpu_count()} cores", flush=True)
    if not args.sim_only:
        reward_path = build_tiny_reward_model(hidden_size=args.rm_hidden, num_hidden_layers=args.rm_layers,
                                              intermediate_size=4 * args.rm_hidden)
        with without_token_auth_notice():
            ray.init(num_cpus=max(os.cpu_count() or 1, 2), include_dashboard=False,
                     log_to_driver=False, _system_config={"worker_niceness": 0})
        results = {}
        try:
            with tempfile.TemporaryDirectory() as tmp:
                train, _ = make_datasets(Path(tmp) / "data", 64, 2, seed=0)
                for name in PLACEMENTS:
                    began = time.perf_counter()
                    results[name] = r = asyncio.run(run_placement(name, args, train, reward_path, Path(tmp)))
                    print(f"{name:<11} step {r['step_s']:.2f} s  generate {r['generate_s']:.2f} s  "
                          f"reward phase {r['reward_s']:.2f} s  scored during generate "
                          f"{r['overlapped_s']:.2f} s  cpu busy {r['cpu_busy']:.0%}  "
                          f"(wall {time.perf_counter() - began:.0f} s)", flush=True)
        finally:
            ray.shutdown()
        share = results["serial"]["reward_s"] / results["serial"]["step_s"]
        print(f"REAL_RATIO {results['overlapped']['step_s'] / results['serial']['step_s']:.2f} "
              f"overlapped / serial step time on this box; reward {share:.0%} of the serial step; "
              f"load average {os.getloadavg()}", flush=True)
    work = Workload()
    for devices in (8, 4, 2):  # the last row (the default pool) is the RATIO's
        reward = RewardClock(devices=devices)
        serial, overlapped, share = simulate(work, args.sim_devices, reward, steps=4, seed=0)
        print(f"simulated GPU clock: {args.sim_devices} rollout devices, reward pool {devices} "
              f"devices: serial {serial:.0f} s, overlapped {overlapped:.0f} s "
              f"({overlapped / serial:.2f}), reward {share:.0%} of the serial step")
    print(f"RATIO {overlapped / serial:.2f} overlapped / serial step time (simulated GPU clock, "
          f"reward {share:.0%} of the serial step)")


if __name__ == "__main__":
    main()
