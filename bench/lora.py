"""Bytes and seconds of one weight sync with LoRA vs a full sync, on SmolLM2-135M-Instruct.

The actor (full fine-tune, then LoRA with `--rank`, alpha 2 x rank, every decoder linear)
exports its sync stream, which goes through the shm checkpoint engine into a native engine in
this process (the product's send_from / receive_into: staged, checked, merged for the adapter,
committed), as a STANDALONE server receives it. Bytes are the sender's `bytes_sent`. Needs
`make smollm2` (`--model tiny:qwen2` runs anywhere, for a smoke test).

    .venv/bin/python bench/lora.py
    .venv/bin/python bench/lora.py --rank 16 --repeats 3

Last line: LORA_RATIO <bytes synced per step with LoRA / bytes of a full sync>
"""

from __future__ import annotations

import argparse
import asyncio
import time

import torch
from transformers import AutoModelForCausalLM

from tandem.config.schema import LoraConfig, OptimConfig, RolloutConfig
from tandem.models.tiny import resolve_model_path
from tandem.rollout.native import NativeRollout
from tandem.training.engine import TrainingEngine
from tandem.weight_sync.participants import receive_into, run_in_fresh_thread, send_from
from tandem.weight_sync.shm import ShmCheckpointEngine

BUCKET_MEGABYTES = 64


def actor(path, lora: LoraConfig | None) -> TrainingEngine:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    engine = TrainingEngine(model, "actor", 4096, optim=OptimConfig(), lora=lora)
    if lora is not None:  # a trained adapter is not zero; B = 0 would sync the same bytes anyway
        with torch.no_grad():
            for name, parameter in engine.model.named_parameters():
                if ".lora_B." in name:
                    parameter.normal_(0.0, 1e-3)
    return engine


async def one_sync(sender: ShmCheckpointEngine, rollout: NativeRollout, trainer: TrainingEngine,
                   version: int) -> tuple[int, float]:
    """(bytes sent, seconds from send start to the engine serving `version`)."""
    plan = sender.build_topology(1, version, [rollout.weight_version])
    start = time.perf_counter()
    sent = run_in_fresh_thread(lambda: send_from(sender, plan, trainer.export_weights()), "bench-send")
    await asyncio.gather(sent, receive_into(rollout, plan, 1, "bench receiver"))
    seconds = time.perf_counter() - start
    assert rollout.weight_version == version
    return sender.bytes_sent, seconds


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    path = resolve_model_path(args.model)
    rollout = NativeRollout.create(path, RolloutConfig(kv_cache_memory_bytes=16 << 20))
    version = 0
    results = {}
    lora = LoraConfig(rank=args.rank, alpha=2.0 * args.rank)
    for label, config in (("full", None), (f"lora r={args.rank}", lora)):
        trainer = actor(path, config)
        sender = ShmCheckpointEngine(BUCKET_MEGABYTES, 300.0)
        try:
            runs = []
            for _ in range(args.repeats):
                version += 1
                runs.append(await one_sync(sender, rollout, trainer, version))
        finally:
            sender.close()
        sent = runs[-1][0]
        best = min(seconds for _, seconds in runs)
        results[label] = sent
        print(f"{label:>12}: {sent / 1e6:9.3f} MB per sync, best of {args.repeats} {best:.3f} s "
              f"(send -> engine serving it; LoRA includes the merge)")
    await rollout.shutdown()
    print(f"LORA_RATIO {results[f'lora r={args.rank}'] / results['full']:.4f}")


if __name__ == "__main__":
    asyncio.run(main())
