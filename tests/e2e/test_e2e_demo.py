"""`tandem demo`, shortened (2 warm-up steps, 8 problems, one GRPO step), end to end."""

import math

from tandem.cli import main
from tandem.trainer.metrics import read_metrics

SHORT = ["--warmup-steps", "2", "--train-size", "8", "--val-size", "2", "trainer.total_steps=1",
         "trainer.test_freq=0", "trainer.save_freq=0", "data.train_batch_size=2", "rollout.n=2",
         "actor.ppo_mini_batch_size=2", "rollout.kv_cache_memory_bytes=16777216",
         "trainer.progress=false"]


def test_short_demo_reports_the_accuracy_it_logged(tmp_path, ray_cluster, capsys):
    output = tmp_path / "demo"
    main(["demo", *SHORT, f"trainer.output_dir={output}"])
    last_line = capsys.readouterr().out.strip().splitlines()[-1]
    records = read_metrics(output / "metrics.jsonl")
    training = [r for r in records if "time/generate" in r]
    validation = {r["step"]: r for r in records if "time/generate" not in r}
    assert [r["step"] for r in training] == [1] and sorted(validation) == [0, 1]
    # the printed before/after accuracies are the logged held-out accuracies at steps 0 and 1
    assert last_line == f"ACCURACY {validation[0]['val/acc']:.3f} {validation[1]['val/acc']:.3f}"
    step = training[0]
    assert step["weight_version"] == 1 and step["rollout_gap/abs_diff_max"] < 1e-4
    assert math.isfinite(step["actor/grad_norm"]) and "reward/tool_use" in step
    assert len((output / "data" / "train.jsonl").read_text().splitlines()) == 8
    assert len((output / "data" / "val.jsonl").read_text().splitlines()) == 2
    assert (output / "reward.png").stat().st_size > 0
