"""Prefill/decode disaggregation (rollout.disaggregation: one prefill + one decode native engine
in one process, rollout/disaggregated.py) vs one plain engine, on a long-prompt multi-turn
workload: 16 sessions of 3 turns, a 768-token first prompt and 128 tool tokens appended each
turn, 32 answer tokens a turn (greedy, eos ignored), all sessions in flight at once, alternating
rounds in one process. Then the KV transfers' GB/s (in process; shm, process to process, into
a TP 2 decode engine whose rank 1 is a worker process; and Mooncake's transfer engine over TCP
on loopback when the pd extra is installed) against a plain memcpy of the same bytes.

    .venv/bin/python bench/pd.py            # ~2 min
    .venv/bin/python bench/pd.py --rounds 3

Prints time to first token (mean over turns), generated tokens/s and KV blocks moved; on this
box PD is expected to lose: both engines step on one event loop (no overlap), and the prompt's
KV is copied once more. Last line: `RATIO <pd/plain tokens/s> ...` with the TTFT ratio and the
transfers' GB/s / memcpy GB/s beside it.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch  # noqa: E402

from tandem.config.schema import DisaggregationConfig, RolloutConfig  # noqa: E402
from tandem.models import TinyModelSpec, build_tiny_model  # noqa: E402
from tandem.rollout.disaggregated import DisaggregatedRollout  # noqa: E402
from tandem.rollout.engine.kv_transfer import MooncakeTransfer  # noqa: E402
from tandem.rollout.native import NativeRollout  # noqa: E402
from tandem.types import GenerateRequest  # noqa: E402

SPEC = TinyModelSpec(architecture="qwen2", hidden_size=256, num_hidden_layers=4,
                     num_attention_heads=4, num_key_value_heads=2, intermediate_size=1024,
                     max_position_embeddings=4096)
SESSIONS, TURNS, PROMPT, TOOL, NEW = 16, 3, 768, 128, 32
CONFIG = RolloutConfig(kv_cache_memory_bytes=256 << 20, block_size=16, max_num_seqs=64)


async def session(engine, index: int, vocab: int, ttft: list[float]) -> int:
    """One multi-turn session; appends each turn's time to first token; returns tokens made."""
    rng = random.Random(index)
    prompt = [rng.randrange(10, vocab) for _ in range(PROMPT)]
    made = 0
    for turn in range(TURNS):
        started = time.perf_counter()
        first = await engine.generate(GenerateRequest(
            f"s{index}", prompt, {"temperature": 0, "max_tokens": 1, "ignore_eos": True}))
        ttft.append(time.perf_counter() - started)  # a 1-token request: prefill + first token
        output = await engine.generate(GenerateRequest(
            f"s{index}", prompt, {"temperature": 0, "max_tokens": NEW, "ignore_eos": True}))
        assert output.token_ids[0] == first.token_ids[0]
        made += len(output.token_ids)
        prompt = prompt + output.token_ids + [rng.randrange(10, vocab) for _ in range(TOOL)]
    return made


async def measure(engine, vocab: int) -> tuple[float, float]:
    """(mean time to first token, generated tokens / s) of all sessions at once."""
    ttft: list[float] = []
    started = time.perf_counter()
    made = sum(await asyncio.gather(*(session(engine, i, vocab, ttft) for i in range(SESSIONS))))
    return sum(ttft) / len(ttft), made / (time.perf_counter() - started)


def transfer_rate(pd: DisaggregatedRollout, transfer, blocks: int = 512, repeats: int = 5
                  ) -> tuple[float, float]:
    """(`transfer`'s GB/s, memcpy GB/s) moving `blocks` KV blocks between the two engines."""
    source, target = pd.prefill_engine, pd.decode_engines[0]
    ids = list(range(blocks))
    transfer.move(source, ids, target, ids)  # warm (Mooncake: registers; shm: maps the files)
    started = time.perf_counter()
    for _ in range(repeats):
        moved = transfer.move(source, ids, target, ids)
    rate = moved * repeats / (time.perf_counter() - started) / 1e9
    flat = torch.empty(moved // 4, dtype=torch.float32)
    into = torch.empty_like(flat)
    into.copy_(flat)
    started = time.perf_counter()
    for _ in range(repeats):
        into.copy_(flat)
    memcpy = moved * repeats / (time.perf_counter() - started) / 1e9
    return rate, memcpy


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    path = build_tiny_model(SPEC)
    plain = NativeRollout.create(path, CONFIG)
    vocab = plain.runner.vocab_size
    pd = DisaggregatedRollout.create(path, dataclasses.replace(
        CONFIG, disaggregation=DisaggregationConfig(enabled=True, decode_replicas=1)))
    results: dict[str, list[tuple[float, float]]] = {"plain": [], "pd": []}
    try:
        await measure(plain, vocab)  # warm both
        await measure(pd, vocab)
        for round_ in range(args.rounds):
            for name, engine in (("plain", plain), ("pd", pd)):
                await engine.clear_kv_cache()
                ttft, rate = await measure(engine, vocab)
                results[name].append((ttft, rate))
                print(f"round {round_} {name:5s} ttft {ttft * 1e3:8.1f} ms  {rate:8.1f} tokens/s",
                      flush=True)
        stats = pd.stats()
        print(f"pd: {stats['kv_transfer_blocks']} KV blocks moved "
              f"({stats['kv_transfer_bytes'] / 1e6:.1f} MB), {stats['handoffs_recomputed']} "
              "handoffs recomputed", flush=True)
        transfer, memcpy = transfer_rate(pd, pd.transfer)
        shm_pd = DisaggregatedRollout.create(path, dataclasses.replace(
            CONFIG, disaggregation=DisaggregationConfig(
                enabled=True, decode_tensor_parallel_size=2, kv_transfer="shm")))
        try:
            shm, shm_memcpy = transfer_rate(shm_pd, shm_pd.transfer)
            shm_big, shm_big_memcpy = transfer_rate(shm_pd, shm_pd.transfer, blocks=2048)
        finally:
            await shm_pd.shutdown()
        try:
            mooncake = transfer_rate(pd, MooncakeTransfer())[0]
        except ImportError as error:
            print(f"mooncake: {error}")
            mooncake = float("nan")
    finally:
        await plain.shutdown()
        await pd.shutdown()
    mean = {name: [sum(v) / len(v) for v in zip(*runs)] for name, runs in results.items()}
    print(f"transfer in process {transfer:.2f} GB/s, shm into TP 2 {shm:.2f} GB/s (memcpy "
          f"{shm_memcpy:.2f} then; 2048 blocks: {shm_big:.2f} vs {shm_big_memcpy:.2f}), Mooncake (TCP, loopback) {mooncake:.2f} GB/s, memcpy "
          f"{memcpy:.2f} GB/s; load {os.getloadavg()[0]:.2f}")
    print(f"RATIO {mean['pd'][1] / mean['plain'][1]:.2f} pd/plain tokens/s (ttft pd/plain "
          f"{mean['pd'][0] / mean['plain'][0]:.2f}, transfer/memcpy GB/s "
          f"{transfer / memcpy:.2f}, shm/memcpy {shm / shm_memcpy:.2f} (2048 blocks "
          f"{shm_big / shm_big_memcpy:.2f}), mooncake/memcpy "
          f"{mooncake / memcpy:.2f}) on {os.cpu_count()} cores")


if __name__ == "__main__":
    asyncio.run(main())
