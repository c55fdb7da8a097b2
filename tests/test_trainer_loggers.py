"""trainer.loggers through the real clients, offline: console lines, wandb (WANDB_MODE=offline)
and MLflow (a local file store)."""

import io
import os

import pytest

from tandem.config.load import ConfigError, load_config
from tandem.trainer.loggers import ConsoleSink
from tandem.trainer.metrics import MetricsLogger, read_metrics

STEPS = [(0, {"val/acc": 0.25, "val/reward": 0.25}),
         (1, {"reward/mean": 0.5, "reward/acc": 0.5, "rollout_gap/abs_diff_mean": 3e-7,
              "time/update": 1.5, "note": "text"}),
         (2, {"reward/mean": 0.75, "reward/acc": 0.75, "val/acc": 0.5, "val/reward": 0.5})]


def test_console_prints_one_line_per_step_and_per_validation():
    stream = io.StringIO()
    sink = ConsoleSink(total_steps=2, stream=stream)
    for step, metrics in STEPS:
        sink.log(step, metrics)
    lines = stream.getvalue().splitlines()
    assert lines[0] == "validation at step 0: acc 0.250, reward 0.250"
    assert lines[1].startswith("step 1/2: reward 0.500, acc 0.500, gap 3.0e-07, step time ")
    assert lines[2].startswith("step 2/2: reward 0.750, acc 0.750, step time ")
    assert lines[3] == "validation at step 2: acc 0.500, reward 0.500"
    assert len(lines) == 4


def test_wandb_offline_run_holds_the_steps(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    logger = MetricsLogger(tmp_path, ["jsonl", "wandb"], 2, "tandem-test", "run-a", {"a": {"b": 1}})
    run = logger.sinks[0].run
    for step, metrics in STEPS:
        logger.log(step, metrics)
    assert run.config["a"] == {"b": 1}
    summary = dict(run.summary)
    assert (summary["_step"], summary["reward/mean"], summary["val/acc"]) == (2, 0.75, 0.5), summary
    assert "note" not in summary  # text is not a metric
    logger.close()
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and len(list(runs[0].glob("*.wandb"))) == 1  # what `wandb sync` uploads
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [0, 1, 2]


def test_mlflow_file_store_run_holds_the_steps(tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", (tmp_path / "mlruns").as_uri())
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 asks for this opt-in
    from mlflow.tracking import MlflowClient

    logger = MetricsLogger(tmp_path, ["mlflow"], 2, "tandem-test", "run-b", {"a": 1})
    run_id = logger.sinks[0].run_id
    for step, metrics in STEPS:
        logger.log(step, metrics)
    logger.close()
    client = MlflowClient()
    run = client.get_run(run_id)
    assert run.info.run_name == "run-b" and run.info.status == "FINISHED"
    history = client.get_metric_history(run_id, "reward/mean")
    assert [(m.step, m.value) for m in history] == [(1, 0.5), (2, 0.75)]
    assert not client.get_metric_history(run_id, "note")  # text is not a metric


def test_loggers_are_checked_at_load():
    with pytest.raises(ConfigError, match="trainer.loggers: unknown value 'neptune'"):
        load_config(overrides=["trainer.loggers=[console,neptune]"])
    assert load_config(overrides=["trainer.loggers=[console,jsonl,tensorboard,wandb,mlflow]"])
