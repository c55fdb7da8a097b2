"""The tensor-parallel native engine (TP=2: rank 0 here, rank 1 a worker process) vs one rank:
decode tokens/s, where a TP=2 step's time goes, and the bytes of one weight update per rank.

    .venv/bin/python bench/tp.py                  # tiny shape, then the 0.5B shape
    .venv/bin/python bench/tp.py --models tiny    # seconds

Workload (per model): `prompts` requests of 8 random tokens x `tokens` new tokens each,
temperature 1, logprobs on, eos ignored, all at once: after the first step every step is a
decode step of the whole batch. TP=1 runs with this process's torch threads (all cores), TP=2
with half of them per rank (each rank a process), so both use the same cores; TP=1 also runs on
one thread, which shows what its OpenMP team costs or gains (on a busy box a preempted team
thread stalls every parallel region, which one-thread ranks do not have). They run in turns,
`--rounds` times; the best round of each counts (the box is shared and noisy).

Where TP=2's time goes (rank 0, one timed round): the plan broadcast (one gloo broadcast per
step), the all-reduces (embedding, then o_proj and down_proj of every layer) and the logits
gather, each timed around its wait, so a collective's time includes waiting for the slower rank;
the rest is rank 0's own compute plus scheduling and sampling. The update bytes are those the
resharding plan gives each rank of the model's full state dict (fp32), and the seconds of one
`update_weights` of it on each engine.

Last line: `RATIO <tp2/tp1 decode tokens/s, largest model run> ...`.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import random
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from tandem.config.schema import RolloutConfig  # noqa: E402
from tandem.models import TinyModelSpec, build_tiny_model  # noqa: E402
from tandem.rollout.engine import rank_worker, tensor_parallel  # noqa: E402
from tandem.rollout.native import NativeRollout  # noqa: E402
from tandem.types import GenerateRequest  # noqa: E402

MODELS = {  # as bench/engine.py's
    "tiny": (TinyModelSpec(architecture="qwen2", hidden_size=256, num_hidden_layers=4,
                           num_attention_heads=4, num_key_value_heads=2, intermediate_size=1024,
                           max_position_embeddings=4096), 64, 128),
    "0.5b": (TinyModelSpec(architecture="qwen2", hidden_size=896, num_hidden_layers=24,
                           num_attention_heads=14, num_key_value_heads=2, intermediate_size=4864,
                           vocab_size=32000, max_position_embeddings=4096), 32, 32),
}


class Timers:
    """Seconds and calls per named section, summed; `wrap` times a function."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.on = False

    def wrap(self, name: str, function):
        def timed(*args, **kwargs):
            if not self.on:
                return function(*args, **kwargs)
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                self.seconds[name] += time.perf_counter() - start
                self.calls[name] += 1
        return timed


TIMERS = Timers()
tensor_parallel.TensorParallel.all_reduce = TIMERS.wrap(
    "all-reduce", tensor_parallel.TensorParallel.all_reduce)
tensor_parallel.TensorParallel.gather_logits = TIMERS.wrap(
    "logits gather", tensor_parallel.TensorParallel.gather_logits)
rank_worker.RankWorkers.step = TIMERS.wrap("plan broadcast", rank_worker.RankWorkers.step)


async def decode_run(rollout: NativeRollout, prompts: list[list[int]], tokens: int,
                     tag: str) -> float:
    """Seconds to generate `tokens` for every prompt at once."""
    params = {"temperature": 1.0, "max_tokens": tokens, "logprobs": True, "ignore_eos": True}
    start = time.perf_counter()
    outs = await asyncio.gather(*(rollout.generate(GenerateRequest(f"{tag}{i}", prompt, params))
                                  for i, prompt in enumerate(prompts)))
    elapsed = time.perf_counter() - start
    assert all(len(out.log_probs) == tokens for out in outs)
    return elapsed


async def bench_model(name: str, rounds: int) -> float:
    spec, num_prompts, tokens = MODELS[name]
    path = build_tiny_model(spec)
    config = RolloutConfig(kv_cache_memory_bytes=256 << 20, max_num_seqs=num_prompts)
    engines = {}
    for tp in (1, 2):
        torch.set_num_threads(CORES)
        engines[tp] = NativeRollout.create(path, dataclasses.replace(
            config, tensor_model_parallel_size=tp))
    # (label, engine, torch threads of this process during its turn): torch's thread count is
    # the process's, so it is set before each turn. TP=2's rank 0 takes half, its worker the
    # other half; TP=1 on one thread shows how much of TP=1 is its OpenMP team (on a busy box a
    # preempted team thread stalls every parallel region)
    runs = [("TP=1", 1, CORES), ("TP=1, 1 thread", 1, 1), ("TP=2", 2, max(1, CORES // 2))]
    rng = random.Random(0)
    vocab = engines[1].runner.vocab_size
    prompts = [[rng.randrange(10, vocab) for _ in range(8)] for _ in range(num_prompts)]
    best = {label: float("inf") for label, _, _ in runs}
    for tp, rollout in engines.items():  # warm-up: kernels, packed weights, first allocations
        torch.set_num_threads(CORES if tp == 1 else max(1, CORES // 2))
        await decode_run(rollout, prompts[:4], 4, f"warm{tp}-")
    for round_index in range(rounds):
        for label, tp, threads in runs:
            rollout = engines[tp]
            torch.set_num_threads(threads)
            timed = tp == 2 and round_index == rounds - 1
            TIMERS.on = timed
            before = rollout.stats()["steps"]
            seconds = await decode_run(rollout, prompts, tokens, f"r{round_index}-{label}-")
            TIMERS.on = False
            best[label] = min(best[label], seconds)
            print(f"    round {round_index} {label}: {seconds:.2f} s", flush=True)
            if timed:
                steps = rollout.stats()["steps"] - before
                breakdown_total = seconds
    generated = num_prompts * tokens
    rates = {label: generated / seconds for label, seconds in best.items()}
    print(f"\n## {name}: {num_prompts} prompts x {tokens} new tokens, best of {rounds}")
    print("| engine | processes x torch threads | seconds | tokens/s |\n|---|---|---|---|")
    for label, tp, threads in runs:
        print(f"| {label} | {tp} x {threads} | {best[label]:.2f} | {rates[label]:,.0f} |")
    print(f"\nTP=2, rank 0, one round ({breakdown_total:.2f} s, {steps} steps):")
    print("| section | calls | seconds | share | per call |\n|---|---|---|---|---|")
    communicated = 0.0
    for section in ("plan broadcast", "all-reduce", "logits gather"):
        seconds, calls = TIMERS.seconds[section], TIMERS.calls[section]
        communicated += seconds
        print(f"| {section} | {calls} | {seconds:.2f} | {seconds / breakdown_total:.0%} | "
              f"{1e6 * seconds / max(calls, 1):.0f} us |")
    rest = breakdown_total - communicated
    print(f"| compute, scheduling, sampling | | {rest:.2f} | {rest / breakdown_total:.0%} | |")
    TIMERS.seconds.clear()
    TIMERS.calls.clear()
    await update_bytes(path, engines)
    for rollout in engines.values():
        await rollout.shutdown()
    print(f"\n{name}: TP=2 / TP=1 tokens/s {rates['TP=2'] / rates['TP=1']:.2f}, TP=2 / TP=1 on "
          f"one thread {rates['TP=2'] / rates['TP=1, 1 thread']:.2f}")
    return rates["TP=2"] / rates["TP=1"]


async def update_bytes(path: Path, engines: dict[int, NativeRollout]) -> None:
    """Bytes each rank receives in one full update, and the seconds of one update_weights."""
    from transformers import AutoModelForCausalLM

    state = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).state_dict()
    runner = engines[2].runner
    layouts = runner.tensor_parallel.layout.all_ranks()
    names = [name for name in state if name in runner.full_shapes]
    full = sum(state[name].numel() * 4 for name in names)
    per_rank = [0] * len(layouts)
    for _, parts in tensor_parallel.reshard(((n, state[n]) for n in names), layouts,
                                            runner.full_shapes, {}):
        for rank, part in enumerate(parts):
            per_rank[rank] += part.numel() * 4
    seconds = {}
    for tp, rollout in engines.items():
        torch.set_num_threads(CORES if tp == 1 else max(1, CORES // 2))
        start = time.perf_counter()
        await rollout.update_weights(state.items(), version=rollout.weight_version + 1)
        seconds[tp] = time.perf_counter() - start
    shares = ", ".join(f"rank {rank} {b / 1e6:.2f} MB ({b / full:.0%})"
                       for rank, b in enumerate(per_rank))
    print(f"\nupdate: full state {full / 1e6:.2f} MB; TP=2 per rank: {shares}; "
          f"update_weights {seconds[1]:.3f} s (TP=1) vs {seconds[2]:.3f} s (TP=2)")
    UPDATE[0] = f"rank1 {per_rank[1] / full:.2f} of the full state"


UPDATE = [""]
CORES = torch.get_num_threads()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="tiny,0.5b")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    models = args.models.split(",")
    print(f"torch {torch.__version__}, {CORES} threads, load average at start "
          f"{os.getloadavg()[0]:.2f}")
    ratio = 0.0
    for name in models:
        ratio = asyncio.run(bench_model(name, args.rounds))
    print(f"load average at the end {os.getloadavg()[0]:.2f}")
    print(f"RATIO {ratio:.2f} tp2/tp1 decode tokens/s, {models[-1]} shape, "
          f"{CORES} threads; update bytes {UPDATE[0]}")


if __name__ == "__main__":
    main()
