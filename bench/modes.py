"""The trainer modes on this box: sync, colocate_async and separate_async on the same task and
the same total samples (tiny model), in one process run.

Response lengths are long-tailed, as multi-turn tool use makes them: a client wrapper gives each
session a budget of `--short` tokens, or `--long` for a `--long-fraction` of them (drawn from
the request id, so every mode sees the same mix), and generation ignores EOS so sessions use
their budget. Equal hardware: sync and colocate_async run `--devices` hybrid workers (FSDP
ranks, each with its engine); separate_async trains on devices/2 and generates on devices/2
standalone replicas. Prints step time, samples/s, trainer idle, rollout idle and the staleness
distribution per mode.

    .venv/bin/python bench/modes.py                 # 2 devices, 6 steps of 4 prompts x 2
Last line: RATIO <separate_async step time / sync step time>
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
import time
import zlib
from collections import Counter, defaultdict
from pathlib import Path

import ray

from tandem.config.load import load_config
from tandem.demo.tasks import make_datasets
from tandem.trainer.metrics import read_metrics
from tandem.trainer.modes import fit
from tandem.fleet.placement import without_token_auth_notice
from tandem.trainer.rl_trainer import RLTrainer
from tandem.types import GenerateRequest

MODES = ("sync", "colocate_async", "separate_async")


def step_seconds(record: dict[str, float]) -> float:
    """Wall time of one step: its phases (time/sync_inner is inside time/sync)."""
    return sum(v for k, v in record.items() if k.startswith("time/") and k != "time/sync_inner")


class LongTailClient:
    """Caps each session's total tokens at its own budget (short or long, from a hash of the
    request id) and turns EOS off; resumed requests keep counting toward the same budget."""

    def __init__(self, inner, short: int, long: int, long_fraction: float) -> None:
        self.inner, self.short, self.long, self.long_fraction = inner, short, long, long_fraction
        self.used: dict[str, int] = defaultdict(int)

    def budget(self, request_id: str) -> int:
        draw = zlib.crc32(request_id.encode()) % 1000 / 1000
        return self.long if draw < self.long_fraction else self.short

    async def generate(self, request):
        request_id, prompt_ids, sampling_params = request.request_id, request.prompt_ids, request.sampling
        left = max(1, self.budget(request_id) - self.used[request_id])
        params = {**sampling_params, "ignore_eos": True,
                  "max_tokens": min(sampling_params["max_tokens"], left)}
        output = await self.inner.generate(GenerateRequest(request_id, prompt_ids, params))
        self.used[request_id] += len(output.token_ids)
        return output


async def run_mode(mode: str, args: argparse.Namespace, data: tuple[Path, Path],
                   directory: Path) -> dict[str, float]:
    """Train `args.steps` steps in `mode`; returns per-step means from its metrics.jsonl."""
    train, _ = data
    devices = args.devices if mode != "separate_async" else args.devices // 2
    overrides = [
        "model.path=tiny:qwen2", f"data.train_files=[{train}]", "data.val_files=[]",
        f"data.train_batch_size={args.batch}", f"rollout.n={args.n}",
        "rollout.prompt_length=320", f"rollout.response_length={args.long}",
        "rollout.kv_cache_memory_bytes=33554432", "rollout.multi_turn.enable=false",
        f"actor.ppo_mini_batch_size={args.batch // 2}", "actor.ppo_max_token_len_per_micro_batch=4096",
        f"trainer.n_devices={devices}", f"actor.fsdp_size={devices}",
        f"trainer.trainer_mode={mode}", f"trainer.total_steps={args.steps}",
        f"trainer.async_rollout.max_staleness={args.max_staleness}",
        "trainer.progress=false", f"trainer.output_dir={directory / mode}"]
    config = load_config(overrides=overrides)
    trainer = RLTrainer(config)
    await trainer.start()
    loop = trainer.runner.loop
    if mode == "sync":
        loop.client = LongTailClient(loop.client, args.short, args.long, args.long_fraction)
    else:  # under the resumable client, which re-asks aborted requests
        loop.client.client = LongTailClient(loop.client.client, args.short, args.long,
                                            args.long_fraction)
    try:
        start = time.perf_counter()
        await fit(trainer)
        wall = time.perf_counter() - start
    finally:
        await trainer.stop()
    records = [r for r in read_metrics(directory / mode / "metrics.jsonl") if "time/update" in r]
    measured = records[1:] or records  # step 1 includes start-up effects of the pipeline
    step_s = sum(step_seconds(r) for r in measured) / len(measured)
    if mode == "sync":  # the trainer waits for generation; the rollout for everything else
        trainer_idle = [r["time/generate"] for r in measured]
    else:
        trainer_idle = [r.get("idle/trainer_seconds", r.get("time/wait_rollout", 0.0)) for r in measured]
    if mode == "sync":
        rollout_idle = [step_seconds(r) - r["time/generate"] for r in measured]
    elif mode == "colocate_async":  # generation is paused from abort to resume
        rollout_idle = [step_seconds(r) - r["time/wait_rollout"] for r in measured]
    else:
        rollout_idle = [r["idle/rollout_seconds"] for r in measured]
    lags: Counter[int] = Counter()
    for record in measured:
        for key, value in record.items():
            if key.startswith("staleness/lag_") and key.endswith("_fraction"):
                lags[int(key[len("staleness/lag_"):-len("_fraction")])] += value / len(measured)
    return {"step_s": step_s, "samples_per_s": args.batch * args.n / step_s, "wall_s": wall,
            "trainer_idle_s": sum(trainer_idle) / len(measured),
            "rollout_idle_s": sum(rollout_idle) / len(measured), "lags": dict(sorted(lags.items())),
            "devices": float(devices)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--batch", type=int, default=4, help="prompts per step")
    parser.add_argument("--n", type=int, default=2)
    parser.add_argument("--short", type=int, default=8)
    parser.add_argument("--long", type=int, default=96)
    parser.add_argument("--long-fraction", type=float, default=0.2)
    parser.add_argument("--max-staleness", type=int, default=2)
    parser.add_argument("--modes", default=",".join(MODES))
    args = parser.parse_args()
    print(f"load average {os.getloadavg()}, {os.cpu_count()} cores")
    with without_token_auth_notice():  # as `tandem train` starts its local cluster
        ray.init(num_cpus=max(os.cpu_count() or 1, 2 * args.devices), include_dashboard=False,
                 log_to_driver=False, _system_config={"worker_niceness": 0})
    results: dict[str, dict] = {}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            data = make_datasets(Path(tmp) / "data", 64, 2, seed=0)
            for mode in args.modes.split(","):
                results[mode] = asyncio.run(run_mode(mode, args, data, Path(tmp)))
                r = results[mode]
                print(f"{mode:<15} devices {r['devices']:.0f} step {r['step_s']:.2f} s  "
                      f"{r['samples_per_s']:.2f} samples/s  trainer idle {r['trainer_idle_s']:.2f} s  "
                      f"rollout idle {r['rollout_idle_s']:.2f} s  lag fractions {r['lags']}  "
                      f"(wall {r['wall_s']:.0f} s)", flush=True)
    finally:
        ray.shutdown()
    print(f"load average {os.getloadavg()}")
    if "sync" in results and "separate_async" in results:
        ratio = results["separate_async"]["step_s"] / results["sync"]["step_s"]
        print(f"RATIO {ratio:.2f} separate_async step time / sync step time, {args.steps} steps of "
              f"{args.batch}x{args.n}, lengths {args.short}/{args.long} ({args.long_fraction:.0%} long)")


if __name__ == "__main__":
    main()
