"""Metrics JSONL, resume truncation, phase timer, PNG plots, and the CLI's data command."""

import json
import math

from tandem.cli import main
from tandem.trainer.metrics import MetricsLogger, PhaseTimer, read_metrics
from tandem.trainer.plots import plot_run


def test_metrics_jsonl_and_truncation(tmp_path):
    logger = MetricsLogger(tmp_path)
    for step in (1, 2, 3):
        logger.log(step, {"reward/mean": step / 10, "bad": math.nan})
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3] and records[0]["bad"] is None
    logger.truncate_after(1)
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1]


def test_phase_timer_accumulates():
    timer = PhaseTimer()
    for _ in range(2):
        with timer.phase("generate"):
            pass
    metrics = timer.metrics()
    assert list(metrics) == ["time/generate"] and metrics["time/generate"] >= 0
    assert [span[0] for span in timer.spans] == ["generate", "generate"]


def test_plots_are_written(tmp_path):
    logger = MetricsLogger(tmp_path)
    logger.log(0, {"val/acc": 0.1})
    for step in (1, 2):
        logger.log(step, {"reward/mean": 0.2 * step, "reward/acc": 0.2 * step,
                          "rollout_gap/abs_diff_mean": 1e-7, "rollout_gap/abs_diff_max": 1e-6,
                          "time/generate": 1.0, "time/update": 0.5, "time/sync": 0.1})
    paths = plot_run(tmp_path)
    assert sorted(p.name for p in paths) == ["logprob_gap.png", "reward.png", "timeline.png"]
    for path in paths:
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # sampling-mask replay's kept mass gets a plot of its own once a step records it
    logger.log(3, {"rollout/kept_mass": 0.8, "time/generate": 1.0, "time/update": 0.5})
    assert "kept_mass.png" in [p.name for p in plot_run(tmp_path)]


def test_async_runs_get_a_staleness_plot(tmp_path):
    logger = MetricsLogger(tmp_path)
    for step, lag1 in ((1, 0.0), (2, 0.5)):
        logger.log(step, {"time/wait_rollout": 0.3, "time/update": 0.5, "staleness/lag_mean": lag1,
                          "staleness/lag_0_fraction": 1 - lag1, "staleness/lag_1_fraction": lag1,
                          "staleness/stale_groups": float(step == 2)})
    paths = plot_run(tmp_path)
    assert "staleness.png" in [p.name for p in paths] and "timeline.png" in [p.name for p in paths]
    assert (tmp_path / "staleness.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_make_data_command(tmp_path, capsys):
    main(["make-data", str(tmp_path), "--train-size", "5", "--val-size", "3"])
    train = [json.loads(line) for line in (tmp_path / "train.jsonl").read_text().splitlines()]
    val = [json.loads(line) for line in (tmp_path / "val.jsonl").read_text().splitlines()]
    assert len(train) == 5 and len(val) == 3
    assert {row["data_source"] for row in train} == {"arithmetic"}
    questions = {row["prompt"][-1]["content"] for row in train}
    assert not questions & {row["prompt"][-1]["content"] for row in val}  # held out
    assert str(tmp_path / "train.jsonl") in capsys.readouterr().out


def test_make_data_refuses_more_problems_than_exist(tmp_path, capsys):
    import pytest

    with pytest.raises(SystemExit) as exit:
        main(["make-data", str(tmp_path), "--kind", "easy", "--train-size", "500"])
    assert exit.value.code == 1
    assert "ValueError: cannot draw 500 + 64 distinct 'easy' problems" in capsys.readouterr().err
    with pytest.raises(ValueError, match="distinct 'easy' problems"):
        main(["--debug", "make-data", str(tmp_path), "--kind", "easy", "--train-size", "500"])


def test_every_timed_phase_has_its_own_timeline_colour():
    import re
    from pathlib import Path

    from tandem.trainer.plots import SYNC_PARTS, TIMELINE_PHASES, phase_colours

    source = Path(__file__).parents[1] / "src" / "tandem"
    timed = {name for path in source.rglob("*.py")
             for name in re.findall(r'phase\("([a-z_]+)"\)', path.read_text())}
    assert timed <= set(TIMELINE_PHASES), f"not on the timeline: {timed - set(TIMELINE_PHASES)}"
    colours = phase_colours()
    assert len(set(colours.values())) == len(TIMELINE_PHASES) + len(SYNC_PARTS) == 17


def test_timeline_draws_reward_overlapping_generate(tmp_path, monkeypatch):
    from matplotlib.axes import Axes

    bars = []
    original = Axes.barh

    def spy(self, y, width, *args, **kwargs):
        bars.append((y, width, kwargs.get("left"), kwargs.get("label"), kwargs.get("hatch")))
        return original(self, y, width, *args, **kwargs)

    monkeypatch.setattr(Axes, "barh", spy)
    logger = MetricsLogger(tmp_path)
    logger.log(1, {"time/generate": 2.0, "time/reward_overlapped": 1.5, "time/update": 0.5})
    plot_run(tmp_path)
    overlap = [bar for bar in bars if bar[4] == "//"]
    # from the step's start (where generate starts), as long as the scoring took
    assert overlap == [(1.3, 1.5, 0.0, "reward (overlapping generate)", "//")]


def test_timeline_splits_a_double_buffered_sync_into_copy_and_flip(tmp_path):
    from pytest import approx

    from tandem.trainer.plots import timeline_segments

    # double-buffered: no abort; the copy ran while generating, the pause is the flip
    step = {"time/generate": 2.0, "time/update": 0.5, "time/sync": 0.5, "sync/copy_s": 0.3,
            "sync/flip_s": 0.01, "sync/pause_s": 0.01, "sync/bytes_moved": 4e8}
    segments = {phase: (start, seconds) for phase, start, seconds in timeline_segments(step)}
    assert segments["sync_copy"] == approx((2.5, 0.3))
    assert segments["sync_pause"] == approx((2.8, 0.01))
    assert segments["sync"] == approx((2.81, 0.19))
    assert segments["resume"] == approx((3.0, 0.0))
    # the abort path: generation stood still for the whole pause, the copy inside it
    aborted = {**step, "sync/abort_s": 0.02, "sync/pause_s": 0.45}
    parts = {phase: seconds for phase, _, seconds in timeline_segments(aborted)}
    assert parts["sync_copy"] == 0.0 and parts["sync_pause"] == approx(0.45)
    assert parts["sync"] == approx(0.05)
    # an in-process sync records no parts: one sync segment
    parts = {phase: seconds for phase, _, seconds in timeline_segments({"time/sync": 0.5})}
    assert parts["sync"] == 0.5 and "sync_copy" not in parts

    logger = MetricsLogger(tmp_path)
    for number in (1, 2):
        logger.log(number, step)
    assert (tmp_path / "timeline.png") in plot_run(tmp_path)
    assert (tmp_path / "timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
