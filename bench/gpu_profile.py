"""Where a native-engine decode step's time goes on one device (docs/gpu.md): the first GPU run
found ~42-59 ms per decode step of the 0.5B shape on an H200, where the model's arithmetic needs
a few ms, so this counts what the host does per step.

    python3 bench/gpu_profile.py                       # CUDA, the 0.5B shape (random weights)
    python3 bench/gpu_profile.py --device cpu --tiny   # the same code on CPU, tiny shape

One batch of `--requests` prompts (16-32 tokens) decodes `--tokens` new tokens each (sampling at
temperature 1, logprobs on, eos ignored) under torch.profiler, after a warm-up. Per decode step:
wall time (also of the same run without the profiler), the host time of the runner's three parts (plan, forward through the layers, sample),
kernel launches, the device's busy time (the sum of kernel times) and host-device syncs. Then the
heaviest host ops. A step is launch-bound when the device is busy for a small part of its wall.
Last line: RATIO <device busy / wall per step> ...
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "src"), str(ROOT / "bench")]

import engine as engine_bench  # noqa: E402  (bench/engine.py: the model shapes)
from tandem.config.schema import RolloutConfig  # noqa: E402
from tandem.models import build_tiny_model  # noqa: E402
from tandem.rollout.native import NativeRollout  # noqa: E402
from tandem.types import GenerateRequest  # noqa: E402

PARTS = ("plan", "forward", "sample")
SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaMemcpyAsync", "cudaMemcpy")


def ranged(name: str, function):
    """`function` under a profiler range of its own."""
    def wrapper(*args, **kwargs):
        with record_function(name):
            return function(*args, **kwargs)
    return wrapper


def ranged_generator(name: str, function):
    """A generator function under a profiler range that lasts until it is drained."""
    def wrapper(*args, **kwargs):
        with record_function(name):
            return (yield from function(*args, **kwargs))
    return wrapper


async def decode(rollout: NativeRollout, prompts: list[list[int]], tokens: int, tag: str) -> None:
    params = {"temperature": 1.0, "max_tokens": tokens, "logprobs": True, "ignore_eos": True}
    outs = await asyncio.gather(*(rollout.generate(GenerateRequest(f"{tag}{i}", prompt, params))
                                  for i, prompt in enumerate(prompts)))
    assert all(len(out.token_ids) == tokens for out in outs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--tiny", action="store_true", help="the tiny shape (CPU dry runs)")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=48)
    args = parser.parse_args()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        sys.exit("gpu_profile.py: --device cuda but torch sees no CUDA device")
    path = build_tiny_model(engine_bench.MODELS["tiny" if args.tiny else "0.5b"])
    config = RolloutConfig(kv_cache_memory_bytes=1 << 30, max_num_seqs=args.requests)
    rollout = NativeRollout.create(path, config, args.dtype, args.device)
    runner = rollout.runner
    runner.plan_step = ranged("plan", runner.plan_step)
    runner.forward_layers = ranged_generator("forward", runner.forward_layers)
    from tandem.rollout.engine import async_engine
    async_engine.sample = ranged("sample", async_engine.sample)
    rng = random.Random(0)
    vocab = runner.vocab_size
    prompts = [[rng.randrange(10, vocab) for _ in range(rng.randint(16, 32))]
               for _ in range(args.requests)]
    asyncio.run(decode(rollout, prompts, 8, "warm"))
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA]
                                           if args.device.startswith("cuda") else [])
    steps_before = rollout.stats()["steps"]
    start = time.perf_counter()
    asyncio.run(decode(rollout, prompts, args.tokens, "t"))  # the same run without the profiler
    plain_wall = time.perf_counter() - start
    plain_steps = rollout.stats()["steps"] - steps_before
    steps_before = rollout.stats()["steps"]
    start = time.perf_counter()
    with profile(activities=activities) as prof:
        asyncio.run(decode(rollout, prompts, args.tokens, "p"))
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
    wall = time.perf_counter() - start
    steps = rollout.stats()["steps"] - steps_before
    events = prof.key_averages()

    def count(name: str) -> int:  # host-side events of that name (ranges have a device twin)
        return sum(event.count for event in events
                   if event.key == name and event.device_type != torch.autograd.DeviceType.CUDA)

    def host_ms(name: str) -> float:
        return sum(event.cpu_time_total for event in events if event.key == name) / 1e3

    launches = count("cudaLaunchKernel") + count("cuLaunchKernel") + count("cudaLaunchKernelExC")
    busy_ms = sum(event.self_device_time_total for event in events) / 1e3  # kernel time
    print(f"# native decode step, {'tiny' if args.tiny else '0.5b'} shape, {args.dtype} on "
          f"{args.device}: {args.requests} requests x {args.tokens} tokens, {steps} steps "
          f"(the first prefills), {wall:.2f} s under the profiler\n")
    print("| per step | value |\n|---|---|")
    print(f"| wall without the profiler | {1e3 * plain_wall / plain_steps:.2f} ms |")
    print(f"| wall | {1e3 * wall / steps:.2f} ms |")
    for part in PARTS:
        print(f"| host: {part} | {host_ms(part) / steps:.2f} ms |")
    print(f"| kernel launches | {launches / steps:.0f} "
          f"({launches / steps / runner.config.num_hidden_layers:.1f} per layer) |")
    print(f"| device busy (kernel time) | {busy_ms / steps:.2f} ms |")
    for name in SYNCS:
        if count(name):
            print(f"| {name} | {count(name) / steps:.1f} |")
    print("\n## heaviest host ops (self time)\n")
    print(events.table(sort_by="self_cpu_time_total", row_limit=15, max_name_column_width=50))
    busy = busy_ms / (1e3 * wall)
    print(f"RATIO {busy:.3f} device busy / wall per decode step ({1e3 * wall / steps:.1f} ms "
          f"wall, {launches / steps:.0f} launches)")


if __name__ == "__main__":
    main()
