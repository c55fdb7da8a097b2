"""`tandem demo`, shortened (2 warm-up steps, 8 problems, one GRPO step), end to end."""

import math

import pytest

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


@pytest.mark.slow  # two demo-sized steps: about a minute on 2 cores
def test_the_demo_with_truncated_sampling_replays_its_kept_sets(tmp_path, ray_cluster, capsys):
    """Issue 39's acceptance run: one step of the demo (the shipped tiny:demo, 8 prompts x 8)
    sampling with top_p=0.7, top_k=20, temperature=0.8, logprobs_mode=processed. Replayed, the
    rollout-vs-actor gap is float32 noise; not replayed, it is every token's -log S (its kept
    set's mass under the full tempered softmax), as the engine reported it in the replayed run
    (on the same samples: the same seed, and replay changes only the actor's side)."""
    sampling = ["--val-size", "2", "rollout.top_p=0.7", "rollout.top_k=20", "rollout.temperature=0.8",
                "rollout.logprobs_mode=processed", "trainer.total_steps=1", "trainer.test_freq=0",
                "trainer.save_freq=0", "trainer.progress=false"]
    steps = {}
    for replay in ("true", "false"):
        output = tmp_path / replay
        main(["demo", *sampling, f"actor.replay_sampling_mask={replay}",
              f"trainer.output_dir={output}"])
        [steps[replay]] = [r for r in read_metrics(output / "metrics.jsonl") if "time/generate" in r]
    on, off = steps["true"], steps["false"]
    mean_log_s = -on["rollout/kept_log_mass"]
    with capsys.disabled():
        print(f"\nrollout_gap/abs_diff_mean: replay on {on['rollout_gap/abs_diff_mean']:.2e}, off "
              f"{off['rollout_gap/abs_diff_mean']:.4f}; mean -log S {mean_log_s:.4f}")
    assert on["reward/mean"] == off["reward/mean"]
    assert on["response/policy_tokens_mean"] == off["response/policy_tokens_mean"]  # same samples
    assert on["rollout_gap/abs_diff_mean"] < 1e-5
    assert mean_log_s > 0.01  # the filters cut real mass on the demo model
    # per token the gap is exactly -log S_t: float32 rounding of log-softmaxes apart
    assert off["rollout_gap/abs_diff_mean"] == pytest.approx(mean_log_s, rel=1e-3, abs=1e-5)
