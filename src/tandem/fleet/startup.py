"""Where a run's start-up time goes: the wall-clock time of each milestone from the process's
start to the first token a rollout engine generated, reported once as one log line and as
`time/startup` (the total) and `time/startup/<milestone>` (each part) in metrics.jsonl."""

from __future__ import annotations

import logging
import os
import time

logger = logging.getLogger(__name__)

# Each part is the time from the milestone recorded before it (or the process start). `tandem
# train` starts Ray right after the config check, before the imports; otherwise Ray comes after
# the trainer's data.
MILESTONES = (
    "config",       # the CLI checked the config and datasets (python start included)
    "ray",          # Ray started (a local cluster) or joined (`tandem train`: here)
    "trainer",      # RLTrainer created: torch, transformers and tandem imported
    "data",         # tokenizer and datasets loaded, run directory written
    "workers",      # training workers placed, started and holding the actor
    "servers",      # rollout engines started and registered with the balancer
    "weights",      # first weight sync, actor -> rollout
    "first_token",  # a rollout engine sampled its first token
)

_IMPORTED_AT = time.time()
_early_marks: dict[str, float] = {}  # milestones recorded before a trainer exists (the CLI's)
_origin: float | None = None  # where start-up is counted from; None: the process start


def process_start_time() -> float:
    """time.time() at which this process started (Linux /proc), else when this module was
    first imported."""
    try:
        with open("/proc/self/stat") as stat:  # field 22: start time in ticks since boot
            ticks = int(stat.read().rsplit(")", 1)[1].split()[19])
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):  # not Linux
        return _IMPORTED_AT
    return time.time() - age


def set_origin(at: float | None) -> None:
    """Count the next runs' start-up from wall-clock time `at` (a library call, or the demo
    after its warm-up), not from the process start; None restores the process start."""
    global _origin
    _origin = at


def has_early_marks() -> bool:
    """Whether the CLI recorded milestones for the next trainer (it counts from the process start)."""
    return bool(_early_marks)


def mark_early(milestone: str) -> None:
    """Record a milestone that happens before the trainer is created (the CLI's config check)."""
    _check(milestone)
    _early_marks.setdefault(milestone, time.time())


class StartupClock:
    """Milestones of one run, measured from the process start."""

    def __init__(self, origin: float | None = None) -> None:
        if origin is None:
            origin = _origin if _origin is not None else process_start_time()
        self.origin = origin
        self.marks = dict(_early_marks)  # the CLI's, for the first trainer of the process only
        _early_marks.clear()
        self.reported = False

    def mark(self, milestone: str, at: float | None = None) -> None:
        """Record `milestone` now (or at wall-clock time `at`); its first record stays."""
        _check(milestone)
        self.marks.setdefault(milestone, time.time() if at is None else at)

    def parts(self) -> dict[str, float]:
        """Seconds of each recorded milestone's part, in the order they happened."""
        parts, previous = {}, self.origin
        for name in sorted(self.marks, key=lambda name: (self.marks[name], MILESTONES.index(name))):
            parts[name] = self.marks[name] - previous
            previous = self.marks[name]
        return parts

    def metrics(self) -> dict[str, float]:
        """time/startup/<milestone> per part; time/startup from the process start to the first
        token (absent when no engine reported one)."""
        metrics = {f"time/startup/{name}": seconds for name, seconds in self.parts().items()}
        if "first_token" in self.marks:
            metrics["time/startup"] = self.marks["first_token"] - self.origin
        return metrics

    def summary(self) -> str:
        """One line: the total and every part."""
        parts = ", ".join(f"{name} {seconds:.1f}" for name, seconds in self.parts().items())
        if "first_token" in self.marks:
            head = f"start-up {self.marks['first_token'] - self.origin:.1f} s to the first token"
        else:
            head = "start-up (the rollout backend reports no first-token time)"
        return f"{head}: {parts} (seconds per part since the process started)"

    def report(self, first_token_times: list[float]) -> dict[str, float]:
        """Once: record the earliest engine's first token, log the summary, return metrics();
        {} on later calls."""
        if self.reported:
            return {}
        self.reported = True
        if first_token_times:
            self.mark("first_token", min(first_token_times))
        logger.info("%s", self.summary())
        return self.metrics()


def _check(milestone: str) -> None:
    if milestone not in MILESTONES:
        raise ValueError(f"unknown start-up milestone {milestone!r}; known: {MILESTONES}")
