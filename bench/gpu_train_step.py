"""One training step of the actor on one device: packed log-probs against the padded path, then
forward, backward and optimizer on the packed path (docs/gpu.md).

    python3 bench/gpu_train_step.py                       # CUDA, the 0.5B shape (random weights)
    python3 bench/gpu_train_step.py --device cpu --tiny   # the same code on CPU, tiny shape

A GRPO-shaped batch (prompts of 16-48 tokens, 2 samples each, responses of 16-48 tokens with two
tool tokens masked out) goes through two TrainingEngines of the same weights: packed (remove
padding, `packed_sdpa`, shared prompts) and padded (plain `sdpa` with a mask). Per dtype (bf16,
then fp32, whose bound is the tighter check), both engines' log-probs are compared with the
float64 log-probs of the same weights, as a fraction of the derived rounding bound
(tests/float_bounds.py): each <= 1, so |packed - padded| <= 2 bounds. Then one bf16 optimizer
step on the packed engine (the PPO loss of trainer/ppo.py): time, tokens/s, peak memory, and a
check that the step moved the log-probs. Exit status 1 when a check fails.
Last line: RATIO <max |packed - padded| / (2 x bf16 bound)>.
"""

from __future__ import annotations

import argparse
import gc
import random
import sys
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "src"), str(ROOT / "tests"), str(ROOT / "bench")]

import engine as engine_bench  # noqa: E402  (bench/engine.py: the model shapes)
from float_bounds import BF16_U, U, max_ratio, token_logprob_bounds  # noqa: E402
from tandem.batch.jagged import make_field, trajectories_to_batch  # noqa: E402
from tandem.batch.trajectory import Trajectory  # noqa: E402
from tandem.config.schema import OptimConfig, TandemConfig  # noqa: E402
from tandem.models import build_tiny_model  # noqa: E402
from tandem.training.losses import actor_loss_fn  # noqa: E402
from tandem.training import packed_attention  # noqa: E402
from tandem.training.engine import TrainingEngine  # noqa: E402

UNITS = {"bfloat16": BF16_U, "float32": U}


def grpo_batch(prompts: int, samples: int, vocab: int, seed: int = 0):
    """`prompts` x `samples` trajectories; samples of a prompt share it (and its uid)."""
    rng = random.Random(seed)
    generator = torch.Generator().manual_seed(seed)
    trajectories = []
    for index in range(prompts):
        prompt = torch.randint(10, vocab, (rng.randint(16, 48),), generator=generator)
        for _ in range(samples):
            length = rng.randint(16, 48)
            mask = torch.ones(length, dtype=torch.long)
            mask[3:5] = 0  # two tool-observation tokens inside the response
            trajectories.append(Trajectory(
                prompts=prompt, responses=torch.randint(10, vocab, (length,), generator=generator),
                response_mask=mask, rollout_log_probs=torch.zeros(length), min_global_steps=0,
                max_global_steps=0, uid=f"p{index}"))
    batch = trajectories_to_batch(trajectories)
    lengths = torch.tensor([len(t.responses) for t in trajectories])
    batch["advantages"] = make_field(torch.randn(int(lengths.sum()), generator=generator), lengths)
    return batch


def load(path: Path, dtype: str, attention: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype),
                                                attn_implementation=attention)


def peak_memory(device: str) -> str:
    if not device.startswith("cuda"):
        return "n/a on cpu"
    return f"{torch.cuda.max_memory_allocated() / 2**30:.2f} GiB"


def check_dtype(path: Path, dtype: str, batch, args) -> tuple[float, bool]:
    """Packed vs padded log-probs of one dtype, in bf16 the optimizer step, then both paths
    against float64; returns the worst |packed - padded| / (2 bound) and the step's verdict."""
    packed = TrainingEngine(load(path, dtype, packed_attention.register()), "actor", 1 << 14,
                            use_remove_padding=True, optim=OptimConfig(lr=1e-4),
                            device=args.device)
    padded = TrainingEngine(load(path, dtype, "sdpa"), "reference", 1 << 14,
                            use_remove_padding=False, device=args.device)
    packed_lp = [row.cpu() for row in packed.compute_log_prob(batch).field("log_probs").unbind()]
    padded_lp = [row.cpu() for row in padded.compute_log_prob(batch).field("log_probs").unbind()]
    gap = max(float((a - b).abs().max()) for a, b in zip(packed_lp, padded_lp))
    print(f"  {dtype}: max |packed - padded| {gap:.3e} over {sum(map(len, packed_lp))} tokens")
    stepped = train_step(packed, batch.clone(), args.device) if dtype == "bfloat16" else True
    del packed
    worst = {"packed": 0.0, "padded": 0.0, "between": 0.0}
    bounds = []
    for index in range(min(args.bound_samples, len(packed_lp))):
        exact, bound = (t.cpu() for t in token_logprob_bounds(
            padded.model, batch["prompts"][index].tolist(), batch["responses"][index].tolist(),
            unit=UNITS[dtype]))
        bounds.append(bound)
        for name, actual, expected, allowed in (("packed", packed_lp[index], exact, bound),
                                                ("padded", padded_lp[index], exact, bound),
                                                ("between", packed_lp[index], padded_lp[index],
                                                 2 * bound)):
            worst[name] = max(worst[name], max_ratio(actual, expected, allowed))
    median = float(torch.cat(bounds).median())
    print(f"  {dtype} vs float64, error / bound (<= 1 is within): packed {worst['packed']:.2e}, "
          f"padded {worst['padded']:.2e}, packed - padded {worst['between']:.2e} "
          f"({len(bounds)} samples, median bound {median:.2e})")
    return worst["between"], stepped


def train_step(engine: TrainingEngine, batch, device: str) -> bool:
    """One optimizer step; True when it ran with finite numbers and moved the log-probs."""
    batch["old_log_probs"] = engine.compute_log_prob(batch).field("log_probs")
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    started = time.perf_counter()
    metrics = engine.train_mini_batch(batch, actor_loss_fn(TandemConfig()))
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - started
    after = engine.compute_log_prob(batch).field("log_probs")
    moved = max(float((a - b).abs().max()) for a, b in zip(after.unbind(),
                                                            batch["old_log_probs"].unbind()))
    tokens = sum(len(row) for row in batch["input_ids"].unbind())
    ok = (metrics["actor/step_skipped"] == 0 and metrics["actor/nonfinite_loss"] == 0
          and moved > 0)
    print(f"  train step: {elapsed:.2f} s for {tokens} tokens ({tokens / elapsed:.0f} tok/s), "
          f"peak memory {peak_memory(device)}, loss {metrics['actor/loss']:.4f}, grad norm "
          f"{metrics['actor/grad_norm']:.3f}, log-probs moved by up to {moved:.2e}: "
          f"{'ok' if ok else 'FAILED'}")
    return ok


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="the tiny shape, 2 prompts x 2 samples")
    parser.add_argument("--bound-samples", type=int, default=2,
                        help="samples checked against float64 (each a float64 forward and "
                             "backward of the model)")
    args = parser.parse_args()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        sys.exit("gpu_train_step.py: --device cuda but torch sees no CUDA device")
    model = "tiny" if args.tiny else "0.5b"
    path = build_tiny_model(engine_bench.MODELS[model])
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(path).vocab_size
    batch = grpo_batch(2 if args.tiny else 8, 2, vocab)
    print(f"torch {torch.__version__}, device {args.device}, {model} shape, "
          f"{batch.batch_size[0]} samples")
    ok = True
    ratios = {}
    for dtype in ("bfloat16", "float32"):
        try:
            ratios[dtype], stepped = check_dtype(path, dtype, batch, args)
            ok &= ratios[dtype] <= 1 and stepped
        except Exception:  # reported; the other dtype still runs
            traceback.print_exc()
            print(f"  the {dtype} run FAILED")
            ok = False
        gc.collect()
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
    shown = ", ".join(f"{d} {r:.2e}" for d, r in ratios.items()) or "not measured"
    print(f"TARGET packed log-probs equal to padded within the bound ({shown} of it) and a finite "
          f"step that moves them: {'met' if ok else 'MISSED'}")
    if "bfloat16" in ratios:
        print(f"RATIO {ratios['bfloat16']:.2e} max |packed - padded| / (2 x bf16 bound), {model} "
              f"shape, {args.device}")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
