"""PNG plots of a run from its metrics.jsonl: reward/accuracy, logprob gap, phase timeline."""

from __future__ import annotations

from pathlib import Path

from tandem.trainer.metrics import read_metrics

TIMELINE_PHASES = ("generate", "sleep", "reward", "old_log_prob", "ref_log_prob", "values",
                   "advantages", "update", "sync")


def _series(records: list[dict], key: str) -> tuple[list[int], list[float]]:
    points = [(r["step"], r[key]) for r in records if r.get(key) is not None]
    return [p[0] for p in points], [p[1] for p in points]


def plot_run(output_dir: str | Path) -> list[Path]:
    """Write reward.png, logprob_gap.png and timeline.png next to metrics.jsonl; return paths."""
    import matplotlib

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
    axis.legend()
    axis.set_title("rollout vs actor log-probability gap")
    written.append(_save(figure, output_dir / "logprob_gap.png"))

    figure, axis = plt.subplots(figsize=(8, 4))
    colors = plt.get_cmap("tab10")
    train = [r for r in records if "time/generate" in r]
    for row, record in enumerate(train):
        left = 0.0
        for index, phase in enumerate(TIMELINE_PHASES):
            seconds = record.get(f"time/{phase}") or 0.0
            axis.barh(record["step"], seconds, left=left, color=colors(index),
                      label=phase if row == 0 else None)
            left += seconds
    axis.set_xlabel("seconds")
    axis.set_ylabel("step")
    axis.yaxis.get_major_locator().set_params(integer=True)
    axis.invert_yaxis()
    axis.legend(ncol=5, fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.15))
    axis.set_title("phase timeline per step")
    written.append(_save(figure, output_dir / "timeline.png"))
    return written


def _save(figure, path: Path) -> Path:
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    import matplotlib.pyplot as plt

    plt.close(figure)
    return path
