"""`tandem train` / `tandem eval` end to end on the tiny model, one run per config path, checked
through the metrics each run writes (and, where two runs share their samples, against each other).

Runs with the same seed and config sample the same tokens, so a path that must not change the
samples (reward placement) must reproduce the baseline's numbers, and a path that adds one term
(the KL loss) must add exactly that term.
"""

import json
import math

import pytest

from tandem.cli import main

BASELINE = ("baseline", "trainer.save_freq=2")
# The engine's top-20 log-probs (logprobs_mode=processed) are renormalised over 20 tokens, the
# actor's over the whole vocabulary when it does not replay the kept sets: a real, systematic
# rollout/actor gap (rollout higher) for the correction tests to correct.
TOP_K_SAMPLING = ("rollout.top_k=20", "rollout.logprobs_mode=processed")
TOP_K = (*TOP_K_SAMPLING, "actor.replay_sampling_mask=false")
CORRECTION = "algorithm.rollout_correction"
ONE_STEP = ("trainer.total_steps=1", "data.val_files=[]")  # for paths one update shows
# PPO as in RLHF: a critic for GAE and an adaptive KL penalty in the reward (one run, two tests).
CLASSIC_PPO = ("classic_ppo", "data.val_files=[]", "algorithm.adv_estimator=gae", "critic.enable=true",
               "critic.optim.lr=0.01", "algorithm.use_kl_in_reward=true", "algorithm.kl_ctrl.type=adaptive",
               "algorithm.kl_ctrl.kl_coef=0.1")
IMPORTANCE_SAMPLING = ("importance_sampling", *ONE_STEP, *TOP_K, f"{CORRECTION}.importance_sampling=token")
SKIP = ("time/", "throughput/", "actor/tokens_per_second", "critic/tokens_per_second")  # wall clock
# The engine's log-probs depend on which requests share a step (the matmul shapes, hence the
# float32 summation order), and that depends on timing: the same tokens, log-probs equal to
# float32 rounding. A log-prob of a tiny model (|logits| ~10, log V ~7) errs by ~eps x 20 ~ 2.4e-6;
# the rollout-vs-actor gap metrics are means of such differences.
ENGINE_ROUNDING = ("rollout_gap/",)
ENGINE_LOGPROB_TOLERANCE = 4 * 20 * 1.2e-7


def finite(value) -> bool:
    """A logged number that is finite (MetricsLogger writes NaN and inf as null)."""
    return isinstance(value, (int, float)) and math.isfinite(value)


def test_train_writes_metrics_plots_and_checkpoint(tiny_runs):
    run = tiny_runs(*BASELINE)
    assert sorted(run.training) == [1, 2] and sorted(run.validation) == [0, 2]
    for step, record in run.training.items():
        assert record["weight_version"] == step
        # after each sync the engine samples from the actor's weights: same log-probs
        assert record["rollout_gap/abs_diff_max"] < 1e-4
        assert finite(record["actor/grad_norm"]) and record["actor/grad_norm"] > 0
        assert record["actor/step_skipped"] == 0.0
        # every policy token of the 4 trajectories is in the loss, padding samples are not
        assert record["actor/global_tokens"] == 4 * record["response/policy_tokens_mean"]
        assert 0.0 <= record["reward/mean"] <= 1.0 and "reward/tool_use" in record
    for record in run.validation.values():
        assert set(record) >= {"val/reward", "val/acc", "val/response_length", "val/num_turns"}
    assert (run.output_dir / "checkpoints" / "latest").read_text() == "2"
    assert (run.output_dir / "config.yaml").exists()
    for plot in ("reward.png", "logprob_gap.png", "timeline.png"):
        assert (run.output_dir / plot).stat().st_size > 0, plot


def test_eval_of_the_checkpoint_reproduces_validation_read_only(tiny_runs, capsys):
    """`tandem eval trainer.resume=true` scores the latest checkpoint with the same greedy
    validation training ran after its last step, and writes nothing into the run directory."""
    run = tiny_runs(*BASELINE)
    before = {path: path.read_bytes() for path in run.output_dir.rglob("*") if path.is_file()}
    capsys.readouterr()
    main(["eval", str(run.config_path), "trainer.resume=true"])
    printed = json.loads(capsys.readouterr().out)
    expected = {k: v for k, v in run.validation[2].items() if k != "step"}
    assert printed == pytest.approx(expected, abs=1e-12)
    after = {path: path.read_bytes() for path in run.output_dir.rglob("*") if path.is_file()}
    assert after == before


def test_reward_after_sampling_matches_agent_loop_placement(tiny_runs):
    """Scoring after sampling instead of inside the agent loop changes when, not what."""
    baseline, run = tiny_runs(*BASELINE), tiny_runs("after_sampling", "reward.placement=after_sampling")
    for records, expected in ((run.training, baseline.training), (run.validation, baseline.validation)):
        assert sorted(records) == sorted(expected)
        for step, record in records.items():
            for key, value in expected[step].items():
                if key.startswith(ENGINE_ROUNDING):
                    assert record[key] == pytest.approx(value, abs=ENGINE_LOGPROB_TOLERANCE), (step, key)
                elif not key.startswith(SKIP) and not key.endswith("_s"):  # _s: seconds
                    assert record[key] == value, (step, key)
    assert run.training[1]["reward/mean"] > 0  # the parity reward scored something


def test_kl_loss_adds_its_term_to_the_actor_loss(tiny_runs):
    """use_kl_loss: the frozen reference is loaded; KL(actor || ref) is 0 before the first update
    and positive after it, and the step's loss is the baseline's plus kl_loss_coef x KL."""
    baseline = tiny_runs(*BASELINE)
    run = tiny_runs("kl_loss", "actor.use_kl_loss=true", "actor.kl_loss_coef=0.1")
    first, second = run.training[1], run.training[2]
    assert first["actor/policy/kl_mean"] == 0.0 and first["actor/ref_kl"] == 0.0
    assert finite(second["actor/policy/kl_mean"]) and second["actor/policy/kl_mean"] > 0
    assert finite(second["actor/ref_kl"]) and second["actor/ref_kl"] > 0
    # low_var_kl has zero gradient at actor == ref, so step 1 moved the weights exactly as the
    # baseline did and step 2 saw the same samples. Tolerance: float32 token means over ~50
    # tokens of O(1) terms (50 x 1.2e-7 x 1).
    assert second["reward/mean"] == baseline.training[2]["reward/mean"]
    expected = baseline.training[2]["actor/loss"] + 0.1 * second["actor/policy/kl_mean"]
    assert second["actor/loss"] == pytest.approx(expected, abs=1e-5)
    assert "actor/policy/kl_mean" not in baseline.training[2]


def test_kl_in_reward_feeds_the_adaptive_controller(tiny_runs):
    run = tiny_runs(*CLASSIC_PPO)
    first, second = run.training[1], run.training[2]
    assert first["kl_in_reward/kl"] == 0.0 and first["kl_in_reward/coef"] == 0.1
    assert finite(second["kl_in_reward/kl"]) and second["kl_in_reward/kl"] > 0
    # After step 1 (KL 0, target 0.1): error clipped to -0.2, 4 trajectories, horizon 10000.
    assert second["kl_in_reward/coef"] == pytest.approx(0.1 * (1 - 0.2 * 4 / 10000), rel=1e-12)
    assert second["actor/ref_kl"] > 0


def test_gae_trains_the_critic(tiny_runs):
    run = tiny_runs(*CLASSIC_PPO)
    for record in run.training.values():
        assert finite(record["critic/loss"]) and record["critic/loss"] > 0
        assert finite(record["critic/grad_norm"]) and record["critic/grad_norm"] > 0
        assert record["critic/step_skipped"] == 0.0 and record["critic/lr"] == 0.01
        assert 0.0 <= record["critic/value_clip_fraction"] <= 1.0
        assert record["critic/global_tokens"] == record["actor/global_tokens"] > 0
        assert record["advantages/abs_mean"] > 0 and record["actor/grad_norm"] > 0


def test_truncated_importance_sampling_weights(tiny_runs):
    run = tiny_runs(*IMPORTANCE_SAMPLING)
    for record in run.training.values():
        gap_max, kl_k1 = record["rollout_gap/abs_diff_max"], record["rollout_gap/kl_k1"]
        weight = record["rollout_correction/weight_mean"]
        assert kl_k1 > 0  # the truncated top-k distribution puts more mass on each kept token
        # weights are exp(old - rollout) <= 1 here (none above the threshold 2, so none truncated);
        # their mean is >= exp(-max gap) and, by Jensen, >= exp(mean log-ratio) = exp(-kl_k1)
        assert record["rollout_correction/truncated_fraction"] == 0.0
        assert math.exp(-gap_max) * (1 - 1e-5) <= weight < 1.0
        assert weight >= math.exp(-kl_k1) * (1 - 1e-5)


def test_replaying_the_kept_sets_closes_the_top_k_gap(tiny_runs):
    """With top_k the actor renormalises over each token's kept set by default (issue 39): the
    gap falls from ~mean log(1 / kept mass) (> log 2 on the tiny model) to float32 rounding, on
    the same samples."""
    run = tiny_runs("replay", *ONE_STEP, *TOP_K_SAMPLING)
    without = tiny_runs(*IMPORTANCE_SAMPLING)
    assert run.training[1]["reward/mean"] == without.training[1]["reward/mean"]  # same samples
    assert without.training[1]["rollout_gap/abs_diff_mean"] > math.log(2)
    assert run.training[1]["rollout_gap/abs_diff_mean"] < 1e-5
    assert run.training[1]["rollout_gap/abs_diff_max"] < ENGINE_LOGPROB_TOLERANCE * 10


def test_rejection_masks_every_off_policy_token(tiny_runs):
    """Every token's ratio is ~exp(-3) < rejection_low 0.5: all are rejected and the actor takes
    no optimizer step (the record says so) instead of learning from the off-policy samples."""
    run = tiny_runs("rejection", *ONE_STEP, *TOP_K, f"{CORRECTION}.rejection=token")
    for record in run.training.values():
        assert record["rollout_gap/abs_diff_mean"] > math.log(2)
        assert record["rollout_correction/rejected_token_fraction"] == 1.0
        assert record["rollout_correction/rejected_sequence_fraction"] == 1.0
        assert record["actor/step_skipped"] == 1.0 and record["actor/global_tokens"] == 0.0
        assert "actor/grad_norm" not in record


def test_bypass_uses_rollout_log_probs_as_old(tiny_runs):
    """bypass_mode: old_log_probs = rollout_log_probs, so their gap is exactly 0 and PPO's first
    ratio is actor / rollout: its ppo_kl is the rollout gap the non-bypass run measures."""
    run = tiny_runs("bypass", *ONE_STEP, *TOP_K, f"{CORRECTION}.bypass_mode=true")
    measured = tiny_runs(*IMPORTANCE_SAMPLING)
    for record in run.training.values():
        for key in ("abs_diff_mean", "abs_diff_max", "kl_k1", "kl_k3"):
            assert record[f"rollout_gap/{key}"] == 0.0
        assert "actor/entropy" not in record  # no actor re-forward happened
    first = run.training[1]
    assert first["reward/mean"] == measured.training[1]["reward/mean"]  # same samples
    # engine vs actor log-probs agree to 1e-4 when they are of the same distribution (the
    # baseline's gap bound), so the two KL estimates agree to that
    assert first["actor/policy/ppo_kl"] == pytest.approx(measured.training[1]["rollout_gap/kl_k1"], abs=1e-4)
    assert first["actor/policy/clip_fraction_lower"] > 0
