"""Where a run's metrics go besides metrics.jsonl (trainer.loggers): the console, TensorBoard,
Weights & Biases and MLflow, each through its own client. WANDB_MODE=offline and a local
MLFLOW_TRACKING_URI (e.g. file:./mlruns) work as those clients define them."""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path
from typing import Any, Protocol

# the console line of a training step: metric -> (label, format)
CONSOLE_STEP = (("reward/mean", "reward", ".3f"), ("reward/acc", "acc", ".3f"),
                ("rollout_gap/abs_diff_mean", "gap", ".1e"))


class Sink(Protocol):
    """One destination of step records."""

    def log(self, step: int, metrics: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


class ConsoleSink:
    """One line per training step (reward, accuracy, rollout gap, step time) and per validation."""

    def __init__(self, total_steps: int, stream: Any = None) -> None:
        self.total_steps = total_steps
        self.stream = stream
        self._last = time.monotonic()

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        previous, now = self._last, time.monotonic()
        self._last = now
        parts = [f"{label} {metrics[key]:{spec}}" for key, label, spec in CONSOLE_STEP
                 if _number(metrics.get(key))]
        if parts:  # step time: wall time since the previous record (validation included)
            self._write(f"step {step}/{self.total_steps}: {', '.join(parts)}, "
                        f"step time {now - previous:.1f}s")
        validation = {key: value for key, value in metrics.items()
                      if key.startswith("val/") and _number(value)}
        if validation:
            self._write(f"validation at step {step}: " + ", ".join(
                f"{key[4:]} {value:.3f}" for key, value in sorted(validation.items())))

    def _write(self, line: str) -> None:
        from tqdm import tqdm

        tqdm.write(line, file=self.stream or sys.stdout)  # above any live progress bar

    def close(self) -> None:
        pass


class TensorBoardSink:
    """Scalars into <output_dir>/tensorboard."""

    def __init__(self, output_dir: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(output_dir / "tensorboard"))

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        for key, value in metrics.items():
            if _number(value):
                self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    """A wandb run (project = trainer.project_name) holding the config and every step."""

    def __init__(self, output_dir: Path, project: str, name: str, config: dict[str, Any]) -> None:
        import wandb

        self.run = wandb.init(project=project, name=name, dir=str(output_dir), config=config,
                              reinit="finish_previous")

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        # one record is a whole step: commit it now (a later record may reuse the step)
        self.run.log({k: v for k, v in metrics.items() if _number(v)}, step=step, commit=True)

    def close(self) -> None:
        self.run.finish()


class MlflowSink:
    """An MLflow run in experiment trainer.project_name, at $MLFLOW_TRACKING_URI (MLflow's own
    default otherwise); the config is logged as config.json."""

    def __init__(self, project: str, name: str, config: dict[str, Any]) -> None:
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient()
        experiment = self.client.get_experiment_by_name(project)
        experiment_id = (experiment.experiment_id if experiment is not None
                         else self.client.create_experiment(project))
        self.run_id = self.client.create_run(experiment_id, run_name=name).info.run_id
        self.client.log_dict(self.run_id, config, "config.json")

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [Metric(key, float(value), now, step) for key, value in metrics.items()
                 if _number(value)]
        if batch:
            self.client.log_batch(self.run_id, metrics=batch)

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


def make_sinks(loggers: list[str], output_dir: Path, total_steps: int, project: str, name: str,
               config: dict[str, Any]) -> list[Sink]:
    """The sinks trainer.loggers names (jsonl is MetricsLogger's own file, always written)."""
    sinks: list[Sink] = []
    for logger in loggers:
        if logger == "console":
            sinks.append(ConsoleSink(total_steps))
        elif logger == "tensorboard":
            sinks.append(TensorBoardSink(output_dir))
        elif logger == "wandb":
            sinks.append(WandbSink(output_dir, project, name, config))
        elif logger == "mlflow":
            sinks.append(MlflowSink(project, name, config))
        elif logger != "jsonl":
            raise ValueError(f"trainer.loggers: unknown logger {logger!r}")
    return sinks


def _number(value: Any) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value))
