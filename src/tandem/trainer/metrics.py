"""Per-step metrics: metrics.jsonl always, plus the loggers trainer.loggers names; phase timers."""

from __future__ import annotations

import json
import math
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Sequence


class MetricsLogger:
    """Appends one JSON object per step to `<output_dir>/metrics.jsonl` and hands the record to
    the other trainer.loggers (trainer/loggers.py)."""

    def __init__(self, output_dir: str | Path, loggers: Sequence[str] = ("jsonl",),
                 total_steps: int = 0, project: str = "tandem", name: str = "",
                 config: dict[str, Any] | None = None) -> None:
        from tandem.trainer.loggers import make_sinks

        self.path = Path(output_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.sinks = make_sinks(list(loggers), Path(output_dir), total_steps, project,
                                name or Path(output_dir).resolve().name, config or {})

    def truncate_after(self, step: int) -> None:
        """Drop records of steps > step (a resumed run rewrites them)."""
        if not self.path.exists():
            return
        kept = [line for line in self.path.read_text().splitlines()
                if line and json.loads(line).get("step", 0) <= step]
        self.path.write_text("".join(line + "\n" for line in kept))

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        """Write the step's metrics; non-finite floats become null in JSON."""
        record = {"step": step, **{k: _clean(v) for k, v in metrics.items()}}
        with self.path.open("a") as handle:
            handle.write(json.dumps(record) + "\n")
        for sink in self.sinks:
            sink.log(step, {k: v for k, v in record.items() if k != "step"})

    def close(self) -> None:
        """Flush and close every logger."""
        for sink in self.sinks:
            sink.close()
        self.sinks = []


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """All records of a metrics.jsonl file."""
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line]


def _clean(value: Any) -> Any:
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class PhaseTimer:
    """Wall time per named phase of a step: `with timer.phase("generate"): ...`."""

    def __init__(self, on_phase=None) -> None:
        self.on_phase = on_phase  # called with the phase name as it starts (progress bars)
        self.times: dict[str, float] = {}
        self.spans: list[tuple[str, float, float]] = []  # (phase, start, end) for the timeline

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        if self.on_phase is not None:
            self.on_phase(name)
        start = time.perf_counter()
        try:
            yield
        finally:
            end = time.perf_counter()
            self.times[name] = self.times.get(name, 0.0) + end - start
            self.spans.append((name, start, end))

    def metrics(self) -> dict[str, float]:
        """{"time/<phase>": seconds} for the step."""
        return {f"time/{name}": seconds for name, seconds in self.times.items()}
