"""PNG plots of a run from its metrics.jsonl: reward/accuracy, logprob gap, phase timeline."""

from __future__ import annotations

import logging
from pathlib import Path

from tandem.extras import install_command
from tandem.trainer.metrics import read_metrics

TIMELINE_PHASES = ("generate", "wait_rollout", "spill_join", "spill_leave", "abort", "sleep", "reward",
                   "old_log_prob", "ref_log_prob", "values", "advantages", "update", "sync", "resize",
                   "resume")
# the parts of a cross-process sync drawn inside its bar (the rest of the sync stays "sync")
SYNC_PARTS = {"sync_copy": "sync copy (generation continues)",
              "sync_pause": "sync flip / pause (generation stopped)"}


def phase_colours() -> dict[str, tuple[float, ...]]:
    """One distinct RGBA colour per timeline phase and sync part (tab20: tab10 repeats after 10)."""
    from matplotlib import colormaps

    palette = colormaps["tab20"]
    free = [index for index in range(palette.N) if index not in (14, 18)]  # the sync parts'
    colours = {phase: tuple(palette(index)) for index, phase in zip(free, TIMELINE_PHASES)}
    return colours | {"sync_copy": tuple(palette(18)), "sync_pause": tuple(palette(14))}


def timeline_segments(record: dict) -> list[tuple[str, float, float]]:
    """(phase, start, seconds) of one step's stacked bar, phases in TIMELINE_PHASES order; the
    sync's copy and pause (cross-process sync metrics) are segments of their own at its start."""
    segments, left = [], 0.0
    for phase in TIMELINE_PHASES:
        seconds = record.get(f"time/{phase}") or 0.0
        for name, part in _sync_parts(record, seconds) if phase == "sync" else [(phase, seconds)]:
            segments.append((name, left, part))
            left += part
    return segments


def _sync_parts(record: dict, seconds: float) -> list[tuple[str, float]]:
    """The sync's `seconds` as copy, pause and the rest. Double-buffered (nothing aborted) the
    copy runs while generation goes on and the pause is the flip; on the abort path the pause
    (abort .. resume) holds the copy. Clamped to `seconds` (the parts come from other clocks)."""
    pause = record.get("sync/pause_s")
    if pause is None:  # in-process sync: no parts recorded
        return [("sync", seconds)]
    copy = 0.0 if "sync/abort_s" in record else min(record.get("sync/copy_s") or 0.0, seconds)
    pause = min(pause, seconds - copy)
    return [("sync_copy", copy), ("sync_pause", pause), ("sync", seconds - copy - pause)]


def _series(records: list[dict], key: str) -> tuple[list[int], list[float]]:
    points = [(r["step"], r[key]) for r in records if r.get(key) is not None]
    return [p[0] for p in points], [p[1] for p in points]


def plot_run(output_dir: str | Path) -> list[Path]:
    """Write reward.png, logprob_gap.png, timeline.png (and staleness.png for the async modes) next
    to metrics.jsonl and return their paths ([] with a warning without matplotlib). The timeline
    also labels a sync's bytes and hatches reward scoring that overlapped generation."""
    try:
        import matplotlib
    except ImportError:
        logging.getLogger(__name__).warning("no plots: matplotlib is not installed (%s); "
                                            "metrics.jsonl has every value",
                                            install_command("plots", "matplotlib"))
        return []

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    output_dir = Path(output_dir)
    records = read_metrics(output_dir / "metrics.jsonl")
    written = []

    figure, axis = plt.subplots(figsize=(7, 4))
    for key, label in (("reward/mean", "train reward"), ("reward/acc", "train accuracy"),
                       ("val/acc", "held-out accuracy")):
        steps, values = _series(records, key)
        if steps:
            axis.plot(steps, values, marker="o" if key.startswith("val") else None, label=label)
    axis.set_xlabel("step")
    axis.set_ylim(-0.05, 1.05)
    if axis.get_legend_handles_labels()[0]:  # a run without these metrics gets an empty panel
        axis.legend()
    axis.set_title("reward and accuracy per step")
    written.append(_save(figure, output_dir / "reward.png"))

    figure, axis = plt.subplots(figsize=(7, 4))
    for key, label in (("rollout_gap/abs_diff_mean", "mean |rollout - actor|"),
                       ("rollout_gap/abs_diff_max", "max |rollout - actor|")):
        steps, values = _series(records, key)
        if steps:
            axis.plot(steps, values, label=label)
    axis.set_yscale("symlog", linthresh=1e-6)
    axis.set_xlabel("step")
    axis.set_ylabel("logprob difference (nats)")
    if axis.get_legend_handles_labels()[0]:  # a run without these metrics gets an empty panel
        axis.legend()
    axis.set_title("rollout vs actor log-probability gap")
    written.append(_save(figure, output_dir / "logprob_gap.png"))

    kept = _series(records, "rollout/kept_mass")
    if kept[0]:  # sampling-mask replay: how much of the distribution truncation kept
        figure, axis = plt.subplots(figsize=(7, 4))
        axis.plot(*kept, color="tab:purple", label="kept mass per sampled token")
        axis.set_ylim(0.0, 1.05)
        axis.set_xlabel("step")
        axis.legend()
        axis.set_title("top-k / top-p kept mass per step")
        written.append(_save(figure, output_dir / "kept_mass.png"))

    figure, axis = plt.subplots(figsize=(8, 4))
    colors = phase_colours()
    train = [r for r in records if "time/update" in r]
    labels = {phase: phase for phase in TIMELINE_PHASES} | SYNC_PARTS
    drawn_overlap, labelled = False, set()
    for record in train:
        segments = timeline_segments(record)
        for phase, left, seconds in segments:
            if seconds > 0:
                axis.barh(record["step"], seconds, left=left, color=colors[phase],
                          label=None if phase in labelled else labels[phase])
                labelled.add(phase)
        if record.get("sync/bytes_moved"):
            end = segments[-1][1] + segments[-1][2] if segments else 0.0
            axis.text(end, record["step"], f" {record['sync/bytes_moved'] / 1e6:.0f} MB synced",
                      va="center", fontsize=7)
        overlapped = record.get("time/reward_overlapped") or 0.0
        if overlapped:  # scored by the reward worker while generation went on (rewards/worker.py)
            axis.barh(record["step"] + 0.3, overlapped, left=0.0, height=0.25, hatch="//",
                      color=colors["reward"], edgecolor="black", linewidth=0.3,
                      label=None if drawn_overlap else "reward (overlapping generate)")
            drawn_overlap = True
    axis.set_xlabel("seconds")
    axis.set_ylabel("step")
    axis.yaxis.get_major_locator().set_params(integer=True)
    axis.invert_yaxis()
    if axis.get_legend_handles_labels()[0]:  # a run without timed phases gets an empty panel
        axis.legend(ncol=4, fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.15))
    axis.set_title("phase timeline per step")
    written.append(_save(figure, output_dir / "timeline.png"))
    if any("staleness/lag_mean" in r for r in records):
        written.append(_plot_staleness(plt, records, output_dir / "staleness.png"))
    return written


def _plot_staleness(plt, records: list[dict], path: Path) -> Path:
    """Per step: the share of consumed groups at each version lag (stacked), and groups over the bound."""
    figure, axis = plt.subplots(figsize=(7, 4))
    steps = [r for r in records if "staleness/lag_mean" in r]
    lags = sorted({int(k.split("_")[1]) for r in steps for k in r if k.startswith("staleness/lag_")
                   and k.endswith("_fraction")})
    bottom = [0.0] * len(steps)
    for lag in lags:
        shares = [r.get(f"staleness/lag_{lag}_fraction") or 0.0 for r in steps]
        axis.bar([r["step"] for r in steps], shares, bottom=bottom, label=f"lag {lag}")
        bottom = [b + s for b, s in zip(bottom, shares)]
    stale = [r.get("staleness/stale_groups") or 0.0 for r in steps]
    if any(stale):
        twin = axis.twinx()
        twin.plot([r["step"] for r in steps], stale, color="black", marker="x", label="over the bound")
        twin.set_ylabel("groups over max_staleness")
    axis.set_xlabel("step")
    axis.set_ylabel("share of the update's groups")
    axis.legend(fontsize=8)
    axis.set_title("version lag of the trajectories in each update")
    return _save(figure, path)


def _save(figure, path: Path) -> Path:
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    import matplotlib.pyplot as plt

    plt.close(figure)
    return path
