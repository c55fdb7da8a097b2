"""The native engine against HF transformers on one device, in bf16 and fp32 (docs/gpu.md).

    python3 bench/gpu_engine.py                       # CUDA, the 0.5B shape (random weights)
    python3 bench/gpu_engine.py --device cpu --tiny   # the same code on CPU, tiny shape

Per dtype, on bench/engine.py's models (built here from a seed) and workloads:
- greedy: 8 prompts x 32 new tokens (eos ignored; --tiny: 4 x 8) from the native engine and
  from HF `generate` one prompt at a time, compared in fp32 (at a mismatch HF's top-2 logit
  margin is printed: a near-tie of random weights, or a bug);
- log-probs: the native engine's greedy tokens scored by HF's teacher-forced forward (the gap),
  and both against the float64 log-probs of the same weights, as a fraction of the derived
  rounding bound (tests/float_bounds.py; bf16 storage for bf16) on the first `--bound-prompts`;
- speed: tokens/s of native vs HF on `uniform` and `rl` (HF's faster cache on uniform, that one
  on rl, as in bench/engine.py), and each engine's peak device memory (CUDA).
Targets (CUDA only; exit status 1 when one is missed): native >= 1.0x HF tokens/s on uniform and
>= 3x on rl in bf16; fp32 greedy tokens equal to HF's; the native log-probs within the bound.
Last line: RATIO <native/HF on rl, bf16>.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import random
import sys
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "src"), str(ROOT / "tests"), str(ROOT / "bench")]

import engine as engine_bench  # noqa: E402  (bench/engine.py: models, workloads, timers)
from float_bounds import BF16_U, U, max_ratio, token_logprob_bounds  # noqa: E402
from tandem.config.schema import RolloutConfig  # noqa: E402
from tandem.models import build_tiny_model  # noqa: E402
from tandem.rollout.native import NativeRollout  # noqa: E402
from tandem.types import GenerateRequest

UNITS = {"bfloat16": BF16_U, "float32": U}
TARGETS = {"uniform": 1.0, "rl": 3.0}  # native / HF tokens/s in bf16 on CUDA


def peak_memory(device: str) -> str:
    if not device.startswith("cuda"):
        return "n/a on cpu"
    return f"{torch.cuda.max_memory_allocated() / 2**30:.2f} GiB"


def reset_memory(device: str) -> None:
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def hf_greedy(model, prompt: list[int], new_tokens: int) -> list[int]:
    """HF `generate`, greedy, one prompt, exactly `new_tokens` (eos off as in the native run)."""
    with torch.inference_mode():
        ids = torch.tensor([prompt], device=model.device)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=new_tokens)
    tokens = out[0, len(prompt):].tolist()
    if len(tokens) != new_tokens:
        raise RuntimeError(f"HF generate stopped after {len(tokens)} of {new_tokens} tokens")
    return tokens


def hf_logits(model, prompt: list[int], response: list[int]) -> torch.Tensor:
    """fp32 logits [R, V] that score each response token, teacher-forced."""
    with torch.inference_mode():
        ids = torch.tensor([prompt + response], device=model.device)
        return model(ids).logits[0, len(prompt) - 1:-1].float()


def run_dtype(path: Path, dtype: str, args, prompts: list[list[int]],
              workloads: dict[str, tuple[list[list[int]], list[int]]], result: dict) -> None:
    """Every measurement of one dtype; prints as it goes and fills `result` with the numbers
    the targets use (what it got before a failure stays)."""
    device = args.device
    result["speed"] = {}
    kv_bytes = (256 << 20) if args.tiny else (2 << 30)
    reset_memory(device)
    rollout = NativeRollout.create(path, RolloutConfig(kv_cache_memory_bytes=kv_bytes), dtype,
                                   device)

    async def greedy():
        return await asyncio.gather(*(rollout.generate(
            GenerateRequest(f"g{i}", prompt, {"temperature": 0, "max_tokens": args.new_tokens, "logprobs": True,
                              "ignore_eos": True})) for i, prompt in enumerate(prompts)))

    outs = asyncio.run(greedy())
    native = {name: asyncio.run(engine_bench.time_native(rollout, *load))
              for name, load in workloads.items()}
    print(f"  native peak memory {peak_memory(device)} (KV cache {kv_bytes >> 20} MiB)")
    asyncio.run(rollout.shutdown())
    del rollout
    reset_memory(device)

    hf = engine_bench.load_hf(path, device, dtype)
    hf.generation_config.eos_token_id = None  # the native runs ignore eos too
    scored, equal, margins = [], 0, []
    for prompt, out in zip(prompts, outs):
        logits = hf_logits(hf, prompt, out.token_ids)
        chosen = torch.tensor(out.token_ids, device=logits.device)[:, None]
        scored.append(logits.log_softmax(-1).gather(-1, chosen)[:, 0].cpu())
        if dtype == "float32":
            reference = hf_greedy(hf, prompt, args.new_tokens)
            equal += reference == out.token_ids
            if reference != out.token_ids:
                at = next(i for i, (a, b) in enumerate(zip(reference, out.token_ids)) if a != b)
                top = hf_logits(hf, prompt, reference)[at].topk(2).values
                margins.append(f"token {at}: HF top-2 margin {float(top[0] - top[1]):.2e}")
    gap = torch.cat([(torch.tensor(out.log_probs) - hf_scored).abs()
                     for out, hf_scored in zip(outs, scored)])
    print(f"  log-prob gap native vs HF (teacher-forced): max {gap.max():.3e}, "
          f"mean {gap.mean():.3e} over {gap.numel()} tokens")
    if dtype == "float32":
        result["greedy_equal"] = (equal, len(prompts))
        print(f"  greedy tokens equal to HF generate: {equal}/{len(prompts)} prompts"
              + "".join(f"\n    mismatch at {where}" for where in margins))
    reset_memory(device)  # HF's own peak: its weights are already in
    hf_speed, best = {}, "static"
    for name, (load_prompts, budgets) in workloads.items():
        caches = ["dynamic", "static"] if name == "uniform" else [best]
        for cache in caches:
            hf_speed[(name, cache)] = sum(budgets) / engine_bench.time_hf(hf, load_prompts,
                                                                          budgets, cache)
        if name == "uniform":
            best = max(caches, key=lambda c: hf_speed[(name, c)])
    print(f"  HF peak memory {peak_memory(device)}")
    for name, (_, budgets) in workloads.items():
        native_speed = sum(budgets) / native[name]
        hf_best = max(v for (n, _), v in hf_speed.items() if n == name)
        caches = ", ".join(f"{c} {v:.0f}" for (n, c), v in hf_speed.items() if n == name)
        result["speed"][name] = native_speed / hf_best
        print(f"  {name}: native {native_speed:.0f} tok/s, HF {caches} tok/s -> "
              f"{native_speed / hf_best:.2f}x")
    # last: a float64 copy of the model, its forward and a backward per token
    ratios, bounds = {"native": [], "hf": []}, []
    for prompt, out, hf_scored in list(zip(prompts, outs, scored))[:args.bound_prompts]:
        exact, bound = (t.cpu() for t in token_logprob_bounds(hf, prompt, out.token_ids,
                                                               unit=UNITS[dtype]))
        bounds.append(bound)
        ratios["native"].append(max_ratio(torch.tensor(out.log_probs), exact, bound))
        ratios["hf"].append(max_ratio(hf_scored, exact, bound))
    print(f"  vs float64 (error / {dtype} rounding bound, <= 1 is within): native "
          f"{max(ratios['native']):.2e}, HF {max(ratios['hf']):.2e} "
          f"({len(bounds)} prompt(s), median bound {float(torch.cat(bounds).median()):.2e})")
    result["bound_ratio"] = max(ratios["native"])
    del hf
    reset_memory(device)


def report_targets(results: dict[str, dict], device: str) -> bool:
    """Print one TARGET line per target; True when all are met (or not applied off CUDA)."""
    applied = device.startswith("cuda")
    met_all = True
    lines = []
    speed = results.get("bfloat16", {}).get("speed", {})
    for name, target in TARGETS.items():
        ratio = speed.get(name)
        lines.append((f"native/HF tokens/s on {name}, bf16 >= {target:g}x: "
                      + ("not measured" if ratio is None else f"{ratio:.2f}x"),
                      ratio is not None and ratio >= target))
    if "float32" in results:
        equal = results["float32"].get("greedy_equal")
        lines.append(("fp32 greedy tokens equal to HF's: "
                      + ("not measured" if equal is None else f"{equal[0]}/{equal[1]}"),
                      equal is not None and equal[0] == equal[1]))
    for dtype, result in results.items():
        ratio = result.get("bound_ratio")
        lines.append((f"native {dtype} log-probs within the rounding bound of float64: "
                      + ("not measured" if ratio is None else f"{ratio:.2e} of it"),
                      ratio is not None and ratio <= 1))
    for text, met in lines:
        verdict = ("met" if met else "MISSED") if applied else "not applied off CUDA"
        print(f"TARGET {text} {verdict}")
        met_all &= met or not applied
    return met_all


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true",
                        help="the tiny shape, 4 prompts, 4 requests of <= 8 tokens per workload")
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--new-tokens", type=int, default=0, help="greedy tokens (32; --tiny 8)")
    parser.add_argument("--bound-prompts", type=int, default=2,
                        help="prompts checked against the float64 log-probs (each costs a "
                             "float64 forward and backward of the model)")
    args = parser.parse_args()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        sys.exit("gpu_engine.py: --device cuda but torch sees no CUDA device")
    model = "tiny" if args.tiny else "0.5b"
    path = build_tiny_model(engine_bench.MODELS[model])
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(path).vocab_size
    rng = random.Random(7)
    count = 4 if args.tiny else 8
    prompts = [[rng.randrange(10, vocab) for _ in range(rng.randint(16, 48))]
               for _ in range(count)]
    args.new_tokens = args.new_tokens or (8 if args.tiny else 32)
    workloads = {name: engine_bench.workload(name, model, vocab) for name in TARGETS}
    if args.tiny:  # the code path, not a measurement: a few short requests
        workloads = {name: (load[0][:4], [min(b, 8) for b in load[1][:4]])
                     for name, load in workloads.items()}
    print(f"torch {torch.__version__}, device {args.device}, {model} shape, "
          f"{args.new_tokens} greedy tokens x {len(prompts)} prompts")
    results: dict[str, dict] = {}
    failed = []
    for dtype in args.dtypes.split(","):
        print(f"{dtype}:")
        results[dtype] = {}
        try:
            run_dtype(path, dtype, args, prompts, workloads, results[dtype])
        except Exception:  # reported; the other dtype still runs
            traceback.print_exc()
            print(f"  the {dtype} run FAILED")
            failed.append(dtype)
    met = report_targets(results, args.device) and not failed
    rl = results.get("bfloat16", {}).get("speed", {}).get("rl")
    if rl is not None:
        print(f"RATIO {rl:.2f} native/HF tokens/s, rl workload, bf16, {model} shape, {args.device}")
    sys.exit(0 if met else 1)


if __name__ == "__main__":
    main()
