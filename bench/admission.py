"""KV-driven admission (rollout.admission=kv, the native default) vs fixed admission (admit
while the prompt's blocks are free; preempt and recompute when running sequences run out):
64 requests submitted at once to a native engine whose KV cache holds ~8 of them at their
worst case (prompt + max_tokens), on a tiny model, in one process, alternating rounds.

    .venv/bin/python bench/admission.py            # ~1 min
    .venv/bin/python bench/admission.py --rounds 3

Workloads (temperature 1, logprobs on, per-request seeds, prefix caching off):
  fixed   every request generates max_tokens = 192 (eos ignored): the worst case is the real one
  varied  max_tokens drawn per request from [32, 192] (eos ignored): known lengths, staggered ends
  stops   max_tokens 192, but 8 stop tokens end each answer early (geometric lengths): admission
          must learn how much of the worst case is used
Prints tokens/s, preemptions, prompt tokens computed (recomputation included) for each policy.
Last line: `RATIO <kv/fixed tokens/s, summed over the three workloads> ...`.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from tandem.config.schema import RolloutConfig  # noqa: E402
from tandem.models import TinyModelSpec, build_tiny_model  # noqa: E402
from tandem.rollout.native import NativeRollout  # noqa: E402
from tandem.types import GenerateRequest  # noqa: E402

SPEC = TinyModelSpec(architecture="qwen2", hidden_size=256, num_hidden_layers=4,
                     num_attention_heads=4, num_key_value_heads=2, intermediate_size=1024,
                     max_position_embeddings=4096)
REQUESTS, PROMPT, NEW, BLOCK, FIT = 64, 64, 192, 16, 8


WORKLOADS = ("fixed", "varied", "stops")


def requests(workload: str, vocab: int) -> list[GenerateRequest]:
    """REQUESTS random prompts of PROMPT tokens and the workload's budgets and stops."""
    rng = random.Random(0)
    stops = tuple(range(3, 3 + max(1, vocab // 64)))  # ~1/64 of the vocabulary ends an answer
    out = []
    for index in range(REQUESTS):
        prompt = [rng.randrange(3 + len(stops), vocab) for _ in range(PROMPT)]
        sampling = {"temperature": 1.0, "max_tokens": NEW, "ignore_eos": True, "seed": index}
        if workload == "varied":
            sampling["max_tokens"] = rng.randrange(32, NEW + 1)
        elif workload == "stops":
            sampling["stop_token_ids"] = list(stops)
        out.append(GenerateRequest(f"{workload}-{index}", prompt, sampling))
    return out


async def serve(path: Path, admission: str, kv_bytes: int, batch: list[GenerateRequest]
                ) -> dict:
    engine = NativeRollout.create(path, RolloutConfig(
        kv_cache_memory_bytes=kv_bytes, block_size=BLOCK, admission=admission,
        enable_prefix_caching=False, max_num_seqs=256))
    try:
        started = time.perf_counter()
        outputs = await asyncio.gather(*(engine.generate(request) for request in batch))
        seconds = time.perf_counter() - started
        stats = engine.stats()
    finally:
        await engine.shutdown()
    tokens = sum(len(output.token_ids) for output in outputs)
    return {"seconds": seconds, "tokens_per_s": tokens / seconds, "tokens": tokens,
            "preemptions": stats["preemptions"], "steps": stats["steps"],
            "prompt_computed": stats["prompt_tokens_computed"],
            "held_back": stats["admission_held_back"]}


async def main(rounds: int) -> None:
    path = build_tiny_model(SPEC)
    probe = NativeRollout.create(path, RolloutConfig(kv_cache_memory_bytes=1 << 20,
                                                     block_size=BLOCK))
    kv_bytes = probe.runner.block_bytes(BLOCK) * FIT * -(-(PROMPT + NEW) // BLOCK)
    vocab = probe.runner.vocab_size
    await probe.shutdown()
    print(f"{REQUESTS} requests of {PROMPT} + {NEW} tokens; KV cache for {FIT} of them "
          f"({kv_bytes / 2**20:.1f} MiB); load average {os.getloadavg()[0]:.2f}")
    best: dict[tuple[str, str], dict] = {}
    for round_index in range(rounds):
        for workload in WORKLOADS:
            for admission in ("fixed", "kv"):
                result = await serve(path, admission, kv_bytes, requests(workload, vocab))
                print(f"  round {round_index} {workload} {admission}: {result['seconds']:.2f} s, "
                      f"{result['preemptions']} preemptions")
                key = (workload, admission)
                if key not in best or result["tokens_per_s"] > best[key]["tokens_per_s"]:
                    best[key] = result
    print("| workload | admission | tokens/s | preemptions | steps | prompt tokens computed | "
          "held back |")
    print("|---|---|---|---|---|---|---|")
    for (workload, admission), r in best.items():
        print(f"| {workload} | {admission} | {r['tokens_per_s']:.0f} | {r['preemptions']} | "
              f"{r['steps']} | {r['prompt_computed']} | {r['held_back']} |")
    seconds = {admission: sum(best[(w, admission)]["tokens"] / best[(w, admission)]["tokens_per_s"]
                              for w in WORKLOADS) for admission in ("fixed", "kv")}
    tokens = {admission: sum(best[(w, admission)]["tokens"] for w in WORKLOADS)
              for admission in ("fixed", "kv")}
    for workload in WORKLOADS:
        ratio = best[(workload, "kv")]["tokens_per_s"] / best[(workload, "fixed")]["tokens_per_s"]
        print(f"{workload}: kv/fixed tokens/s {ratio:.2f}, preemptions "
              f"{best[(workload, 'kv')]['preemptions']} vs {best[(workload, 'fixed')]['preemptions']}")
    ratio = (tokens["kv"] / seconds["kv"]) / (tokens["fixed"] / seconds["fixed"])
    print(f"load average at the end {os.getloadavg()[0]:.2f}")
    print(f"RATIO {ratio:.2f} kv/fixed admission tokens/s over the three workloads, "
          f"{REQUESTS} requests into a KV cache for {FIT}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    asyncio.run(main(parser.parse_args().rounds))
