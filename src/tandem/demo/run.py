"""`tandem demo`: GRPO with the calculator tool on a tiny model that a supervised warm-up taught
the tool-call format (shipped as model.path tiny:demo; `--warmup-steps N` redoes the warm-up);
prints held-out accuracy before and after, and `ACCURACY <before> <after>` last."""

from __future__ import annotations

import time
from pathlib import Path

from tandem.config.load import load_config
from tandem.demo.tasks import make_datasets

DEMO_CONFIG = Path(__file__).with_name("demo.yaml")


def run_demo(overrides: list[str] = (), train_size: int = 512, val_size: int = 64,
             warmup_steps: int | None = None) -> tuple[float, float]:
    """The whole demo; returns (held-out accuracy before GRPO, after GRPO). warmup_steps None:
    start from the shipped warmed-up model; a number: warm up here (cached). Fewer warm-up
    steps and problems give a quick smoke run (the accuracy then means little)."""
    from tandem.job import Trainer

    started = time.time()
    config = load_config(DEMO_CONFIG, list(overrides))
    output = Path(config.trainer.output_dir)
    from tandem.models.tiny import DEMO_MODEL_DIR

    if warmup_steps is None and not (DEMO_MODEL_DIR / "config.json").is_file():
        warmup_steps = 400
        print(f"[demo] no shipped warmed-up model in {DEMO_MODEL_DIR} (`make demo-model` makes "
              "it): warming up here first")
    if warmup_steps is None:
        model = "tiny:demo"
        print("[demo] starting from the shipped warmed-up model (tiny:demo; `make demo-model` "
              "rebuilds it)")
    else:
        from tandem.demo.warmup import DEMO_MODEL, WarmupRecipe, warm_up
        from tandem.models.tiny import build_tiny_model

        print(f"[demo] warm-up: {warmup_steps} supervised steps on tool-use transcripts (cached "
              "after the first run)")
        model = warm_up(WarmupRecipe(base_model=str(build_tiny_model(DEMO_MODEL)),
                                     steps=warmup_steps), config.trainer.progress)
    train_file, val_file = make_datasets(output / "data", train_size, val_size, config.data.seed)
    config = load_config(DEMO_CONFIG, [f"model.path={model}", f"data.train_files=[{train_file}]",
                                       f"data.val_files=[{val_file}]", *overrides])
    print(f"[demo] GRPO with the calculator tool: {config.trainer.total_steps} steps x "
          f"{config.data.train_batch_size} prompts x n={config.rollout.n}")

    accuracy: dict[int, float] = {}

    def report(step: int, metrics: dict[str, float]) -> None:
        accuracy[step] = metrics["val/acc"]
        when = "before GRPO" if step == 0 else f"after step {step}"
        print(f"[demo] held-out accuracy {when}: {metrics['val/acc']:.3f} "
              f"(tool use {metrics.get('val/tool_use', 0):.2f})", flush=True)

    after = Trainer(config).fit(on_validation=report)  # start-up counts from here, not the warm-up
    print(f"[demo] metrics {output / 'metrics.jsonl'}; plots in {output}; "
          f"{time.time() - started:.0f} s")
    before = accuracy[0]
    print(f"ACCURACY {before:.3f} {after['val/acc']:.3f}")
    return before, after["val/acc"]
