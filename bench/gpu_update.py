"""Weight updates into a generating native engine on one device (docs/gpu.md), fp32.

    python3 bench/gpu_update.py                       # CUDA, the 0.5B shape (random weights)
    python3 bench/gpu_update.py --device cpu --tiny   # the same code on CPU, tiny shape

Two syncs over the `naive` checkpoint engine (actor and rollout in one process, as HYBRID runs
them) into a NativeRollout that is decoding greedy requests when each sync lands:
- full: a TrainingEngine whose weights were moved off the engine's (a random step) exports every
  weight;
- LoRA: a rank-16 TrainingEngine on the moved weights exports only its adapter (B random, not
  zero), which the engine merges.
After each: every in-flight output's `version_runs` covers its tokens, old version first then the
new one (the request was not lost or restarted); the engine's log-probs of a fresh greedy request
on the same prompts (a prefix-cache hit if the cache had kept stale entries) equal HF's
teacher-forced log-probs of the new weights (peft-merged for LoRA) to within 1% of how far the
old weights are from them, and the greedy tokens are compared with HF `generate`. Exit status 1
when a check fails. Last line: LORA_RATIO <adapter bytes / full bytes per sync>.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import sys
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "src"), str(ROOT / "bench")]

import engine as engine_bench  # noqa: E402  (bench/engine.py: the model shapes)
from tandem.config.schema import LoraConfig, OptimConfig, RolloutConfig  # noqa: E402
from tandem.models import build_tiny_model  # noqa: E402
from tandem.rollout.native import NativeRollout  # noqa: E402
from tandem.training.engine import TrainingEngine  # noqa: E402
from tandem.types import GenerateRequest  # noqa: E402
from tandem.weight_sync.naive import NaiveCheckpointEngine  # noqa: E402


def moved_model(path: Path, device: str, seed: int):
    """The model with every weight moved by 2% of its own spread: a stand-in for a trained step."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            noise = torch.randn(parameter.shape, generator=generator)
            parameter.add_(noise * 0.02 * parameter.float().std().clamp_min(1e-3))
    return model.to(device)


def teacher_forced(model, prompt: list[int], response: list[int]) -> torch.Tensor:
    """HF's log-probs [R] of `response` after `prompt`."""
    with torch.inference_mode():
        ids = torch.tensor([prompt + response], device=model.device)
        logits = model(ids).logits[0, len(prompt) - 1:-1].float()
        chosen = torch.tensor(response, device=logits.device)[:, None]
        return logits.log_softmax(-1).gather(-1, chosen)[:, 0].cpu()


def hf_greedy(model, prompt: list[int], new_tokens: int) -> list[int]:
    with torch.inference_mode():
        ids = torch.tensor([prompt], device=model.device)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=new_tokens, eos_token_id=None)
    return out[0, len(prompt):].tolist()


def counted(stream, sizes: list[int]):
    """Pass the export stream through, adding up its bytes."""
    for name, tensor in stream:
        sizes.append(tensor.numel() * tensor.element_size())
        yield name, tensor


async def sync_while_generating(rollout: NativeRollout, actor: TrainingEngine, prompts,
                                version: int, long_tokens: int) -> tuple[list, int, float]:
    """Start greedy requests, sync `actor` into `rollout` once they have tokens, let them finish;
    returns (outputs, bytes synced, seconds of the sync)."""
    requests = [asyncio.create_task(rollout.generate(GenerateRequest(
        f"v{version}-{i}", prompt, {"temperature": 0, "max_tokens": long_tokens, "logprobs": True,
                                    "ignore_eos": True}))) for i, prompt in enumerate(prompts)]
    steps = rollout.stats()["steps"]
    while rollout.stats()["steps"] < steps + 4:  # a few decode steps under the old weights
        await asyncio.sleep(0.001)
    sizes: list[int] = []
    started = time.perf_counter()
    await NaiveCheckpointEngine().sync(counted(actor.export_weights(), sizes), rollout, version)
    seconds = time.perf_counter() - started
    return await asyncio.gather(*requests), sum(sizes), seconds


def check_versions(outputs, old: int, new: int) -> bool:
    """Every output: old-version tokens first, then new-version ones, covering all its tokens."""
    ok = True
    for out in outputs:
        runs = out.version_runs
        good = [version for version, _ in runs] == [old, new]
        ok &= good
        print(f"    version runs {runs} "
              f"over {len(out.token_ids)} tokens: {'ok' if good else 'FAILED'}")
    return ok


async def check_serving(rollout: NativeRollout, new_model, old_model, prompts, new_tokens: int,
                        tag: str) -> bool:
    """The engine's log-probs of fresh greedy requests are HF's of the new weights."""
    outs = await asyncio.gather(*(rollout.generate(GenerateRequest(
        f"{tag}-check-{i}", prompt, {"temperature": 0, "max_tokens": new_tokens, "logprobs": True,
                                     "ignore_eos": True})) for i, prompt in enumerate(prompts)))
    to_new = to_old = 0.0
    equal = 0
    for prompt, out in zip(prompts, outs):
        engine = torch.tensor(out.log_probs)
        to_new = max(to_new, float((engine - teacher_forced(new_model, prompt, out.token_ids)).abs().max()))
        to_old = max(to_old, float((engine - teacher_forced(old_model, prompt, out.token_ids)).abs().max()))
        equal += hf_greedy(new_model, prompt, new_tokens) == out.token_ids
    ok = to_new <= 0.01 * to_old
    print(f"    {tag}: max |engine - HF(new)| {to_new:.2e}, |engine - HF(old)| {to_old:.2e} "
          f"(must be <= 1% of it): {'ok' if ok else 'FAILED'}; greedy tokens equal to HF "
          f"generate of the new weights {equal}/{len(prompts)} (random weights can tie)")
    return ok


async def run(args) -> bool:
    model = "tiny" if args.tiny else "0.5b"
    path = build_tiny_model(engine_bench.MODELS[model])
    from transformers import AutoConfig, AutoModelForCausalLM

    vocab = AutoConfig.from_pretrained(path).vocab_size
    generator = torch.Generator().manual_seed(3)
    prompts = [torch.randint(10, vocab, (24 + 4 * i,), generator=generator).tolist()
               for i in range(4)]
    long_tokens, new_tokens = (64, 8) if args.tiny else (256, 32)
    kv_bytes = (64 << 20) if args.tiny else (1 << 30)
    rollout = NativeRollout.create(path, RolloutConfig(kv_cache_memory_bytes=kv_bytes),
                                   "float32", args.device)
    print(f"torch {torch.__version__}, device {args.device}, {model} shape, fp32, "
          f"{len(prompts)} requests of {long_tokens} tokens in flight per sync")
    base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(args.device)
    await asyncio.gather(*(rollout.generate(GenerateRequest(  # fill the prefix cache at version 0
        f"warm-{i}", p, {"temperature": 0, "max_tokens": 4, "ignore_eos": True}))
        for i, p in enumerate(prompts)))
    ok, sizes = True, {}

    print("  full sync (every weight, moved):")
    moved = moved_model(path, "cpu", seed=1)
    actor = TrainingEngine(copy.deepcopy(moved), "actor", 1 << 14, optim=OptimConfig(),
                           device=args.device)
    outputs, sizes["full"], seconds = await sync_while_generating(rollout, actor, prompts, 1,
                                                                  long_tokens)
    print(f"    {sizes['full'] / 1e6:.1f} MB in {seconds:.3f} s into the generating engine")
    ok &= check_versions(outputs, 0, 1)
    moved = moved.to(args.device)
    ok &= await check_serving(rollout, moved, base, prompts, new_tokens, "full")
    del actor, base

    print("  LoRA sync (rank 16, the adapter only, merged by the engine):")
    lora = TrainingEngine(copy.deepcopy(moved).cpu(), "actor", 1 << 14, optim=OptimConfig(),
                          device=args.device, lora=LoraConfig(rank=16, alpha=32.0))
    with torch.no_grad():
        for name, parameter in lora.model.named_parameters():
            if ".lora_B." in name:
                parameter.normal_(0.0, 0.02)
    outputs, sizes["lora"], seconds = await sync_while_generating(rollout, lora, prompts, 2,
                                                                  long_tokens)
    print(f"    {sizes['lora'] / 1e6:.2f} MB in {seconds:.3f} s into the generating engine")
    ok &= check_versions(outputs, 1, 2)
    merged = copy.deepcopy(lora.model).merge_and_unload()
    ok &= await check_serving(rollout, merged, moved, prompts, new_tokens, "lora")
    if args.device.startswith("cuda"):
        print(f"  peak CUDA memory {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB")
    await rollout.shutdown()
    print(f"TARGET weight updates land mid-generation (versions per token) and serve the new "
          f"weights, full and LoRA: {'met' if ok else 'MISSED'}")
    print(f"LORA_RATIO {sizes['lora'] / sizes['full']:.4f} adapter bytes / full bytes per sync, "
          f"{model} shape, {args.device}")
    return ok


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="the tiny shape, shorter requests")
    args = parser.parse_args()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        sys.exit("gpu_update.py: --device cuda but torch sees no CUDA device")
    try:
        ok = asyncio.run(run(args))
    except Exception:
        traceback.print_exc()
        ok = False
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
