"""The whole RL step (generate -> log-probs -> update -> sync) on SmolLM2-135M-Instruct: tandem
vs TRL's GRPOTrainer on the same GRPO job, in one run.

    .venv/bin/python bench/rl_step.py                      # tandem, then TRL if .venv-trl exists
    .venv/bin/python bench/rl_step.py --steps 5 --no-trl   # tandem alone: per-phase times
    .venv/bin/python bench/rl_step.py --logits-memory      # peak memory: full vs chunked logits
    .venv/bin/python bench/rl_step.py --micro-batch-memory 0.5 1  # estimate vs peak of budgets
    .venv-trl/bin/python bench/rl_step.py --hf-check       # plain HF speed in a venv (PYTHONPATH=src)

Job (issue 17): the `easy` sums task, 4 prompts x 4 completions per step, 96-token prompts,
48-token completions, temperature 1, no KL, one optimizer step per batch (strictly on-policy),
fp32, lr 1e-5. Needs `make smollm2`; TRL comes from `make trl` (its own venv; this script
re-runs itself there with `--trl-run`). Both final models are judged by the same greedy scorer
(HF generate, chat template, tandem.rewards) on the same held-out prompts. The last line is
`RATIO <tandem median step time / TRL median step time> smollm2 grpo`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
TRL_PYTHON = ROOT / ".venv-trl" / "bin" / "python"
PHASES = ("generate", "sleep", "reward", "old_log_prob", "ref_log_prob", "values", "advantages",
          "update", "sync")


def read_rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def greedy_accuracy(model_dir: str, tokenizer_dir: str, rows: list[dict], max_new_tokens: int) -> float:
    """Held-out accuracy of greedy replies (HF generate, chat template), scored by tandem.rewards."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tandem.rewards import compute_reward

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    prompts = [tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=False)
               for row in rows]
    inputs = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    eos = tokenizer.eos_token_id
    with torch.no_grad():
        output = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False,
                                eos_token_id=eos, pad_token_id=eos)
    texts = tokenizer.batch_decode(output[:, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
    scores = [compute_reward(row["data_source"], text, row["ground_truth"], row.get("extra_info") or {})
              for row, text in zip(rows, texts)]
    return sum(float(score.extra.get("acc", score.score)) for score in scores) / len(scores)


# ---- tandem ----------------------------------------------------------------------------------

def run_tandem(args: argparse.Namespace, data: Path, out: Path) -> dict:
    """RLTrainer + fit_sync with examples/smollm2.yaml's job; per-phase medians from metrics.jsonl."""
    import asyncio

    import ray

    from tandem.config.load import load_config
    from tandem.trainer.metrics import read_metrics
    from tandem.trainer.rl_trainer import RLTrainer
    from tandem.trainer.sync import fit_sync

    config = load_config(str(ROOT / "examples" / "smollm2.yaml"), [
        f"data.train_files=[{data / 'train.jsonl'}]", "data.val_files=[]",
        f"data.train_batch_size={args.prompts}", f"actor.ppo_mini_batch_size={args.prompts}",
        f"rollout.n={args.n}", f"rollout.prompt_length={args.prompt_length}",
        f"rollout.response_length={args.response_length}", f"actor.optim.lr={args.lr}",
        f"trainer.total_steps={args.steps}", f"trainer.save_freq={args.steps}", "trainer.test_freq=0",
        "trainer.progress=false", f"trainer.output_dir={out}"])

    async def run() -> float:
        started = time.perf_counter()
        trainer = RLTrainer(config)
        await trainer.start()
        ready = time.perf_counter() - started
        try:
            await fit_sync(trainer)
        finally:
            await trainer.stop()
        return ready

    try:
        start_up = asyncio.run(run())
    finally:
        ray.shutdown()
    steps = [r for r in read_metrics(out / "metrics.jsonl") if "time/generate" in r]
    phases = {p: statistics.median(r.get(f"time/{p}", 0.0) for r in steps) for p in PHASES}
    step_times = [sum(r.get(f"time/{p}", 0.0) for p in PHASES) for r in steps]
    return {"start_up": start_up, "phases": phases, "step": statistics.median(step_times),
            "model": str(out / "checkpoints" / f"step_{args.steps}" / "actor"),
            "reward": [r.get("reward/mean") for r in steps]}


# ---- TRL (runs inside .venv-trl) ---------------------------------------------------------------

def trl_run(args: argparse.Namespace) -> None:
    """GRPOTrainer on the same job; writes step times and the final model under --trl-run."""
    import torch
    from datasets import load_dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from tandem.rewards import compute_reward

    out = Path(args.trl_run)
    torch.manual_seed(args.seed)

    def reward(completions, ground_truth, data_source, extra_info, **_):
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return [compute_reward(ds, text, gt, info or {}).score
                for text, gt, ds, info in zip(texts, ground_truth, data_source, extra_info)]

    class StepTimes(TrainerCallback):
        def __init__(self):
            self.times, self.started = [], 0.0

        def on_step_begin(self, *_, **__):
            self.started = time.perf_counter()

        def on_step_end(self, *_, **__):
            self.times.append(time.perf_counter() - self.started)

    config = GRPOConfig(
        output_dir=str(out / "trainer"), per_device_train_batch_size=args.prompts * args.n,
        num_generations=args.n, max_completion_length=args.response_length, learning_rate=args.lr,
        max_steps=args.steps, beta=0.0, num_iterations=1, temperature=1.0, logging_steps=1,
        save_strategy="no", report_to=[], use_cpu=True, bf16=False, seed=args.seed,
        gradient_checkpointing=not args.trl_no_checkpointing)
    timer = StepTimes()
    trainer = GRPOTrainer(model=args.model, reward_funcs=reward, args=config,
                          train_dataset=load_dataset("json", data_files=args.train)["train"],
                          callbacks=[timer])
    generation = []
    generate = trainer._generate_and_score_completions

    def timed_generate(*a, **k):  # sampling + rewards + old log-probs, TRL's "rollout" phase
        started = time.perf_counter()
        result = generate(*a, **k)
        generation.append(time.perf_counter() - started)
        return result

    trainer._generate_and_score_completions = timed_generate
    started = time.perf_counter()
    trainer.train()
    trainer.save_model(str(out / "model"))
    (out / "times.json").write_text(json.dumps({"steps": timer.times, "generate": generation,
                                                "total": time.perf_counter() - started}))


def run_trl(args: argparse.Namespace, data: Path, model: str, out: Path) -> dict:
    command = [str(TRL_PYTHON), __file__, "--trl-run", str(out), "--model", model,
               "--train", str(data / "train.jsonl"), "--steps", str(args.steps), "--lr", str(args.lr),
               "--prompts", str(args.prompts), "--n", str(args.n), "--response-length",
               str(args.response_length), "--seed", str(args.seed)] + (
                   ["--trl-no-checkpointing"] if args.trl_no_checkpointing else [])
    started = time.perf_counter()
    subprocess.run(command, check=True, env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    times = json.loads((out / "times.json").read_text())
    step = statistics.median(times["steps"])
    generate = statistics.median(times["generate"])
    return {"wall": time.perf_counter() - started, "step": step, "generate": generate,
            "train": step - generate, "model": str(out / "model")}


# ---- memory of the log-prob head -----------------------------------------------------------------

def logits_memory_child(mode: str) -> None:
    """`step-full|step-chunked`: one actor forward + backward of a 16 x (40 + 48)-token batch;
    `head-full|head-chunked`: the LM head alone on those 768 response tokens' hidden states.
    Prints the peak RSS growth over the resident size before it."""
    import torch
    from transformers import AutoModelForCausalLM

    from tandem.batch.jagged import trajectories_to_batch
    from tandem.batch.trajectory import Trajectory
    from tandem.models.smollm2 import smollm2_path
    from tandem.training.forward import actor_forward, token_entropy, token_log_probs
    from tandem.training.lm_head import DEFAULT_CHUNK_BYTES, chunk_tokens, chunked_log_probs

    model = AutoModelForCausalLM.from_pretrained(smollm2_path(), dtype=torch.float32)
    chunked = mode.endswith("chunked")
    if mode.startswith("head"):
        head = model.get_output_embeddings()
        hidden = torch.randn(768, head.in_features, requires_grad=True)
        labels = torch.randint(0, head.out_features, (768,))
        Path("/proc/self/clear_refs").write_text("5")
        before = _status_kib("VmRSS")
        started = time.perf_counter()
        if chunked:
            log_probs, entropy = chunked_log_probs(hidden, head, labels, 1.0, "grad", chunk_tokens(head.out_features))
        else:
            logits = head(hidden)
            log_probs, entropy = token_log_probs(logits, labels), token_entropy(logits)
        (log_probs.sum() + entropy.sum()).backward()
        print(json.dumps({"peak_growth_mib": (_status_kib("VmHWM") - before) / 1024,
                          "seconds": time.perf_counter() - started}))
        return
    generator = torch.Generator().manual_seed(0)
    batch = trajectories_to_batch([
        Trajectory(prompts=torch.randint(10, 40000, (40,), generator=generator),
                   responses=torch.randint(10, 40000, (48,), generator=generator),
                   response_mask=torch.ones(48, dtype=torch.long), rollout_log_probs=torch.zeros(48),
                   min_global_steps=0, max_global_steps=0) for _ in range(16)])
    Path("/proc/self/clear_refs").write_text("5")  # reset the peak-RSS mark (VmHWM) to now
    before = _status_kib("VmRSS")
    started = time.perf_counter()
    out = actor_forward(model, batch, True, 1.0, calculate_entropy=True,
                        logits_chunk_bytes=DEFAULT_CHUNK_BYTES if chunked else None)
    (out.log_probs.sum() + out.entropy.sum()).backward()
    print(json.dumps({"peak_growth_mib": (_status_kib("VmHWM") - before) / 1024,
                      "seconds": time.perf_counter() - started}))


def _status_kib(field: str) -> int:
    line = next(l for l in Path("/proc/self/status").read_text().splitlines() if l.startswith(field + ":"))
    return int(line.split()[1])


def logits_memory() -> None:
    """Each measurement in a fresh process. A fixed mmap threshold makes glibc return every freed
    large block at once (its default threshold grows after the first free, after which freed
    blocks stay resident), so the peak RSS follows the live tensors."""
    results = {}
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "PYTHONPATH": str(ROOT / "src")}
    for mode in ("head-full", "head-chunked", "step-full", "step-chunked"):
        output = subprocess.run([sys.executable, __file__, "--logits-memory-child", mode], check=True,
                                capture_output=True, text=True, env=env).stdout
        results[mode] = json.loads(output.strip().splitlines()[-1])
        print(f"{mode:13s}: peak RSS growth {results[mode]['peak_growth_mib']:8.1f} MiB, "
              f"forward+backward {results[mode]['seconds']:.1f} s", flush=True)
    print(f"RATIO {results['head-chunked']['peak_growth_mib'] / results['head-full']['peak_growth_mib']:.2f} "
          "chunked/full peak memory of the smollm2 LM head, 768 response tokens")


def micro_batch_memory_child(memory_gb: float) -> None:
    """One actor forward + backward (log-probs + entropy, packed) of 96 + 48-token sequences
    filling the token budget that actor.micro_batch_memory_gb=`memory_gb` derives for SmolLM2
    (fp32). A warm-up step allocates the parameter gradients first, so the peak RSS growth is
    what the micro-batch itself adds. Prints tokens, the estimate and the peak."""
    import torch
    from transformers import AutoModelForCausalLM

    from tandem.batch.jagged import trajectories_to_batch
    from tandem.batch.trajectory import Trajectory
    from tandem.models.smollm2 import smollm2_path
    from tandem.training.forward import actor_forward
    from tandem.training.lm_head import DEFAULT_CHUNK_BYTES
    from tandem.training.memory_budget import GB, ModelShape, activation_bytes, tokens_for_memory

    model = AutoModelForCausalLM.from_pretrained(smollm2_path(), dtype=torch.float32)
    shape = ModelShape.from_hf_config(model.config.to_dict())
    tokens = tokens_for_memory(int(memory_gb * GB), shape, 4, False, DEFAULT_CHUNK_BYTES)
    generator = torch.Generator().manual_seed(0)

    def batch(lengths: list[int]):
        return trajectories_to_batch([
            Trajectory(prompts=torch.randint(10, 40000, (length - length // 3,), generator=generator),
                       responses=torch.randint(10, 40000, (length // 3,), generator=generator),
                       response_mask=torch.ones(length // 3, dtype=torch.long),
                       rollout_log_probs=torch.zeros(length // 3), min_global_steps=0, max_global_steps=0)
            for length in lengths])

    def step(micro_batch) -> None:
        out = actor_forward(model, micro_batch, True, 1.0, calculate_entropy=True)
        (out.log_probs.sum() + out.entropy.sum()).backward()

    step(batch([16]))
    model.zero_grad(set_to_none=False)  # keep the gradients' memory: it is not the micro-batch's
    lengths = [144] * (tokens // 144) + ([tokens % 144] if tokens % 144 >= 3 else [])
    micro_batch = batch(lengths)
    Path("/proc/self/clear_refs").write_text("5")
    before = _status_kib("VmRSS")
    started = time.perf_counter()
    step(micro_batch)
    print(json.dumps({"tokens": sum(lengths), "estimate": activation_bytes(shape, 4, sum(lengths), False, DEFAULT_CHUNK_BYTES),
                      "peak": (_status_kib("VmHWM") - before) * 1024, "seconds": time.perf_counter() - started}))


def micro_batch_memory(budgets: list[float]) -> None:
    """Each budget in a fresh process (glibc set up as in logits_memory): the derived token
    budget, the estimated activation bytes and the measured peak RSS growth."""
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "PYTHONPATH": str(ROOT / "src")}
    ratios = []
    for memory_gb in budgets:
        output = subprocess.run([sys.executable, __file__, "--micro-batch-memory-child", str(memory_gb)],
                                check=True, capture_output=True, text=True, env=env).stdout
        result = json.loads(output.strip().splitlines()[-1])
        ratios.append(result["peak"] / result["estimate"])
        print(f"actor.micro_batch_memory_gb={memory_gb:g}: {result['tokens']} tokens, estimate "
              f"{result['estimate'] / 2**20:.1f} MiB, measured peak RSS growth {result['peak'] / 2**20:.1f} MiB "
              f"({ratios[-1]:.2f}x), forward+backward {result['seconds']:.1f} s", flush=True)
    print(f"RATIO {max(ratios):.2f} measured/estimated micro-batch memory, smollm2 fp32 packed (max over budgets)")


def hf_check() -> None:
    """Plain HF work in whichever venv runs this script (compare .venv with .venv-trl, and the
    box's state): one forward + backward of 16 x 88 tokens, one greedy generate of 16 x 48."""
    import torch
    from transformers import AutoModelForCausalLM

    from tandem.models.smollm2 import smollm2_path

    model = AutoModelForCausalLM.from_pretrained(smollm2_path(), dtype=torch.float32)
    ids = torch.randint(10, 40000, (16, 88), generator=torch.Generator().manual_seed(0))
    started = time.perf_counter()
    model(input_ids=ids).logits.logsumexp(-1).sum().backward()
    backward = time.perf_counter() - started
    model.eval()
    started = time.perf_counter()
    with torch.no_grad():
        model.generate(ids[:, :40], max_new_tokens=48, min_new_tokens=48, do_sample=False, pad_token_id=2)
    print(f"{sys.prefix}: {torch.get_num_threads()} threads, forward+backward {backward:.1f} s, "
          f"generate 16 x 48 {time.perf_counter() - started:.1f} s, load average {os.getloadavg()}")


# ---- main ----------------------------------------------------------------------------------------

def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--prompt-length", type=int, default=96)
    parser.add_argument("--response-length", type=int, default=48)
    parser.add_argument("--val-size", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-trl", action="store_true", help="tandem alone, even if .venv-trl exists")
    parser.add_argument("--trl-no-checkpointing", action="store_true",
                        help="TRL without gradient checkpointing (its GRPOConfig default is on)")
    parser.add_argument("--logits-memory", action="store_true", help="peak memory: full vs chunked logits")
    parser.add_argument("--hf-check", action="store_true", help="time plain HF work in this venv")
    parser.add_argument("--micro-batch-memory", type=float, nargs="+", metavar="GB",
                        help="peak memory of micro-batches sized by actor.micro_batch_memory_gb")
    parser.add_argument("--micro-batch-memory-child", type=float, help=argparse.SUPPRESS)
    parser.add_argument("--logits-memory-child", help=argparse.SUPPRESS)
    parser.add_argument("--trl-run", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--train", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.trl_run:
        return trl_run(args)
    if args.logits_memory_child is not None:
        return logits_memory_child(args.logits_memory_child)
    if args.logits_memory:
        return logits_memory()
    if args.hf_check:
        return hf_check()
    if args.micro_batch_memory_child is not None:
        return micro_batch_memory_child(args.micro_batch_memory_child)
    if args.micro_batch_memory:
        return micro_batch_memory(args.micro_batch_memory)

    from tandem.demo.tasks import make_datasets
    from tandem.models.smollm2 import smollm2_path

    model = str(smollm2_path())
    print(f"load average at start: {os.getloadavg()}", flush=True)
    with tempfile.TemporaryDirectory(prefix="rl_step_") as tmp:
        work = Path(tmp)
        make_datasets(work / "data", 256, args.val_size, args.seed, "easy")
        held_out = read_rows(work / "data" / "val.jsonl")
        before = greedy_accuracy(model, model, held_out, args.response_length)
        print(f"held-out greedy accuracy before training: {before:.3f}", flush=True)
        tandem = run_tandem(args, work / "data", work / "tandem")
        tandem_accuracy = greedy_accuracy(tandem["model"], model, held_out, args.response_length)
        print(f"tandem: start-up {tandem['start_up']:.1f} s, median step {tandem['step']:.2f} s "
              f"({args.prompts * args.n / tandem['step']:.2f} samples/s), held-out accuracy "
              f"{before:.3f} -> {tandem_accuracy:.3f} after {args.steps} steps")
        print("tandem median phase times (s): " + ", ".join(
            f"{p} {t:.2f}" for p, t in tandem["phases"].items() if t > 0.005), flush=True)
        if args.no_trl or not TRL_PYTHON.exists():
            print("TRL: not run (`make trl` builds .venv-trl)" if not args.no_trl else "TRL: skipped (--no-trl)")
            print(f"load average at end: {os.getloadavg()}")
            return
        trl = run_trl(args, work / "data", model, work / "trl")
        trl_accuracy = greedy_accuracy(trl["model"], model, held_out, args.response_length)
        print(f"TRL: median step {trl['step']:.2f} s ({args.prompts * args.n / trl['step']:.2f} samples/s; "
              f"generate+score {trl['generate']:.2f}, train {trl['train']:.2f}), held-out accuracy "
              f"{before:.3f} -> {trl_accuracy:.3f} after {args.steps} steps")
        print(f"load average at end: {os.getloadavg()}")
        print(f"RATIO {tandem['step'] / trl['step']:.2f} smollm2 grpo")


if __name__ == "__main__":
    main()
