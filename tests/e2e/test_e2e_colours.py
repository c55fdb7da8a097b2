"""The vision example as a user runs it (examples/colours.yaml; issue 40): `tandem make-data
--kind colours`, then `tandem train` of the example config on tiny:colours, 2 steps, in sync and
separate_async; the held-out accuracy is logged (its rise over the full 80 steps is in
bench/RESULTS.md)."""

from pathlib import Path

import pytest

from tandem.cli import main
from tandem.trainer.metrics import read_metrics

pytestmark = pytest.mark.slow
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "colours.yaml"


@pytest.mark.parametrize("mode", ["sync", "separate_async"])
def test_the_colours_example_trains_and_logs_held_out_accuracy(tmp_path, mode):
    main(["make-data", str(tmp_path / "data"), "--kind", "colours"])
    train, val = tmp_path / "data" / "train.jsonl", tmp_path / "data" / "val.jsonl"
    assert len(train.read_text().splitlines()) == 96 and len(val.read_text().splitlines()) == 24
    extra = ["trainer.async_rollout.max_staleness=0", "rollout.nnodes=1",
             "rollout.n_gpus_per_node=1"] if mode == "separate_async" else []
    main(["train", str(EXAMPLE), f"data.train_files=[{train}]", f"data.val_files=[{val}]",
          f"trainer.output_dir={tmp_path / 'run'}", "trainer.total_steps=2", "trainer.test_freq=2",
          "trainer.progress=false", f"trainer.trainer_mode={mode}", *extra])
    records = read_metrics(tmp_path / "run" / "metrics.jsonl")
    held_out = [r["val/acc"] for r in records if "val/acc" in r]
    assert len(held_out) == 2 and all(0.0 <= acc <= 1.0 for acc in held_out)
    trained = [r for r in records if "time/update" in r]
    assert [r["step"] for r in trained] == [1, 2]
    assert all(r["rollout_gap/abs_diff_max"] < 1e-4 for r in trained)
