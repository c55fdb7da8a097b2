"""`tandem train` in each trainer mode with one TP=2 native replica (rollout.
tensor_model_parallel_size=2 on a standalone footprint of 2 devices: rank 0 in the server, rank 1
a worker process), issue 37. The rollout-vs-actor log-prob gap after each sync says every rank
serves the actor's weights: a rank left on old weights would move the logits by ~lr. The async
modes run with max_staleness=0, so every sample is on-policy and the gap is rounding only. The
same with one data-parallel replica of two engine groups (rollout.data_parallel_size=2)."""

import pytest

pytestmark = pytest.mark.slow

TP2 = ("rollout.tensor_model_parallel_size=2", "rollout.nnodes=1", "rollout.n_gpus_per_node=2",
       "data.val_files=[]")


@pytest.mark.parametrize("mode", ["sync", "colocate_async", "separate_async"])
def test_each_mode_trains_with_a_tensor_parallel_replica(tiny_runs, mode):
    run = tiny_runs(mode, f"trainer.trainer_mode={mode}", *TP2,
                    *(() if mode == "sync" else ("trainer.async_rollout.max_staleness=0",)))
    assert sorted(run.training) == [1, 2]
    assert run.training[1]["rollout/engine_ranks"] == 2.0  # one replica of two ranks
    for record in run.training.values():
        # a float32 forward split over two ranks vs the actor's: rounding only (~1e-6 here)
        assert record["rollout_gap/abs_diff_max"] < 1e-4
        assert record["actor/step_skipped"] == 0.0
    # step 2 sampled from the weights step 1 trained, synced to both ranks
    assert [run.training[step]["weight_version"] for step in (1, 2)] == [1, 2]
    assert run.training[2].get("staleness/token_lag_max", 0) == 0  # (sync logs no lag)
    assert run.training[1]["actor/grad_norm"] > 0  # step 1 moved the weights step 2 sampled


@pytest.mark.parametrize("mode", ["sync", "colocate_async", "separate_async"])
def test_each_mode_trains_with_a_data_parallel_replica(tiny_runs, mode):
    """rollout.data_parallel_size=2: one replica of two engine groups behind one address
    (rollout/data_parallel.py); every group serves the actor's weights after each sync."""
    run = tiny_runs(f"dp-{mode}", f"trainer.trainer_mode={mode}", "rollout.data_parallel_size=2",
                    "rollout.nnodes=1", "rollout.n_gpus_per_node=2", "data.val_files=[]",
                    *(() if mode == "sync" else ("trainer.async_rollout.max_staleness=0",)))
    assert sorted(run.training) == [1, 2]
    assert run.training[1]["rollout/engine_ranks"] == 2.0  # two engines of one rank
    for record in run.training.values():
        assert record["rollout_gap/abs_diff_max"] < 1e-4
        assert record["actor/step_skipped"] == 0.0
    assert [run.training[step]["weight_version"] for step in (1, 2)] == [1, 2]
    assert run.training[1]["actor/grad_norm"] > 0
