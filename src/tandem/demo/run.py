"""`tandem demo`: warm up a tiny model on tool-use transcripts, then GRPO with the calculator
tool; prints held-out accuracy before and after, and `ACCURACY <before> <after>` last."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from tandem.config.load import load_config
from tandem.demo.tasks import make_datasets
from tandem.demo.warmup import WarmupRecipe, warm_up
from tandem.models.tiny import TinyModelSpec, build_tiny_model

DEMO_CONFIG = Path(__file__).with_name("demo.yaml")
# The policy: a 0.9M-parameter Qwen2 (hidden 128, 4 layers) with the local 1k-token tokenizer.
DEMO_MODEL = TinyModelSpec(hidden_size=128, num_hidden_layers=4, num_attention_heads=4,
                           num_key_value_heads=2, intermediate_size=384, seed=1)


def run_demo(overrides: list[str] = (), train_size: int = 512, val_size: int = 64,
             warmup_steps: int = 400) -> tuple[float, float]:
    """The whole demo; returns (held-out accuracy before GRPO, after GRPO). Fewer warm-up steps
    and problems give a quick smoke run (the accuracy then means little)."""
    from tandem.trainer.plots import plot_run
    from tandem.trainer.rl_trainer import RLTrainer
    from tandem.trainer.modes import fit

    started = time.time()
    config = load_config(DEMO_CONFIG, list(overrides))
    output = Path(config.trainer.output_dir)
    print(f"[demo] warm-up: supervised phase on tool-use transcripts (cached after the first run)")
    model = warm_up(WarmupRecipe(base_model=str(build_tiny_model(DEMO_MODEL)), steps=warmup_steps),
                    config.trainer.progress)
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

    async def train() -> tuple[float, float]:
        trainer = RLTrainer(config)
        await trainer.start()
        try:
            after = await fit(trainer, on_validation=report)
        finally:
            await trainer.stop()
        return accuracy[0], after["val/acc"]

    before, after = asyncio.run(train())
    plots = plot_run(output)
    print(f"[demo] metrics {output / 'metrics.jsonl'}; plots {', '.join(str(p) for p in plots)}; "
          f"{time.time() - started:.0f} s")
    print(f"ACCURACY {before:.3f} {after:.3f}")
    return before, after
