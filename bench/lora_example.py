"""examples/smollm2_lora.yaml vs examples/smollm2.yaml (the full fine-tune): median step time,
greedy held-out accuracy before and after, and the training worker's peak memory (actor,
optimizer and the hybrid engine live in that one process): its whole-run high-water mark
(ru_maxrss) and the one of the 20 steps alone (VmHWM reset through /proc/self/clear_refs after
start-up, Linux).

    .venv/bin/python bench/lora_example.py                 # both, 20 steps each
    .venv/bin/python bench/lora_example.py --only lora

Last line: LORA_STEP_RATIO <LoRA / full median step> peak <LoRA / full whole-run RSS peak>
steps_peak <LoRA / full peak RSS of the steps alone>
"""

from __future__ import annotations

import argparse
import asyncio
import resource
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# the phases of a sync-mode step (bench/rl_step.py's), summed as the step time
PHASES = ("generate", "sleep", "reward", "old_log_prob", "ref_log_prob", "values", "advantages",
          "update", "sync")
EXAMPLES = {"full": ROOT / "examples" / "smollm2.yaml", "lora": ROOT / "examples" / "smollm2_lora.yaml"}


def _peak_rss_bytes(worker) -> tuple[int, int]:  # runs inside the training worker
    """(ru_maxrss of the whole run, VmHWM since _reset_peak) in bytes."""
    status = Path("/proc/self/status").read_text()
    hwm = next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmHWM:"))
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, hwm * 1024


def _reset_peak(worker) -> None:  # runs inside the training worker
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := the current RSS


def run(example: str, output_dir: Path) -> dict:
    import ray

    from tandem.config.load import load_config
    from tandem.trainer.metrics import read_metrics
    from tandem.trainer.rl_trainer import RLTrainer
    from tandem.trainer.sync import fit_sync

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    config = load_config(str(EXAMPLES[example]), [f"trainer.output_dir={output_dir}",
                                                  "trainer.progress=false"])

    async def train() -> tuple[int, int]:
        trainer = RLTrainer(config)
        await trainer.start()
        try:
            await trainer.workers[0].__ray_call__.remote(_reset_peak)
            await fit_sync(trainer)
            return await trainer.workers[0].__ray_call__.remote(_peak_rss_bytes)
        finally:
            await trainer.stop()

    started = time.perf_counter()
    try:
        peak = asyncio.run(train())
    finally:
        ray.shutdown()
    records = read_metrics(output_dir / "metrics.jsonl")
    steps = [r for r in records if "time/generate" in r]
    accuracy = {r["step"]: r["val/acc"] for r in records if "val/acc" in r}
    return {"wall": time.perf_counter() - started, "step": statistics.median(sum(r.get(f"time/{p}", 0.0) for p in PHASES) for r in steps),
            "sync": statistics.median(r["time/sync"] for r in steps),
            "acc": (accuracy.get(0), accuracy.get(max(accuracy))), "peak": peak[0],
            "steps_peak": peak[1]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=sorted(EXAMPLES))
    parser.add_argument("--output-dir", default="/tmp/tandem-lora-example")
    args = parser.parse_args()
    results = {}
    for example in [args.only] if args.only else ["lora", "full"]:
        result = results[example] = run(example, Path(args.output_dir) / example)
        before, after = result["acc"]
        print(f"{example:>5}: wall {result['wall']:.0f} s, median step {result['step']:.2f} s "
              f"(sync {result['sync']:.3f} s), val/acc {before:.3f} -> {after:.3f} "
              f"({after - before:+.3f}), worker peak RSS {result['peak'] / 2**30:.2f} GiB (steps only "
              f"{result['steps_peak'] / 2**30:.2f} GiB)", flush=True)
    if len(results) == 2:
        print(f"LORA_STEP_RATIO {results['lora']['step'] / results['full']['step']:.3f} "
              f"peak {results['lora']['peak'] / results['full']['peak']:.3f} "
              f"steps_peak {results['lora']['steps_peak'] / results['full']['steps_peak']:.3f}")


if __name__ == "__main__":
    main()
