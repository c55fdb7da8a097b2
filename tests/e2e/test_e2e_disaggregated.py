"""`tandem train` in each trainer mode with one prefill/decode replica (rollout.disaggregation:
one prefill and one decode native engine in the replica's server, a standalone footprint of 2
devices), issue 38. The rollout-vs-actor log-prob gap after each sync says both engines serve
the actor's weights and the KV handed from prefill to decode is the new weights' (a decode on
old-weight KV would move the logits by ~lr). The async modes run with max_staleness=0, so every
sample is on-policy and the gap is rounding only."""

import pytest

pytestmark = pytest.mark.slow

PD = ("rollout.disaggregation.enabled=true", "rollout.nnodes=1", "rollout.n_gpus_per_node=2",
      "data.val_files=[]")


@pytest.mark.parametrize("mode", ["sync", "colocate_async", "separate_async"])
def test_each_mode_trains_with_a_prefill_decode_replica(tiny_runs, mode):
    run = tiny_runs(mode, f"trainer.trainer_mode={mode}", *PD,
                    *(() if mode == "sync" else ("trainer.async_rollout.max_staleness=0",)))
    assert sorted(run.training) == [1, 2]
    for record in run.training.values():
        assert record["rollout_gap/abs_diff_max"] < 1e-4  # rounding only: same weights
        assert record["actor/step_skipped"] == 0.0
        assert record["rollout/kv_transfer_blocks"] > 0  # the step's handoffs moved KV
    assert [run.training[step]["weight_version"] for step in (1, 2)] == [1, 2]
    assert run.training[1]["actor/grad_norm"] > 0  # step 1 moved the weights step 2 sampled


def test_tensor_parallel_engines_train_through_the_shm_transfer(tiny_runs):
    """A TP 2 prefill engine (rank 1 a process of its own) and a TP 1 decode engine: the KV
    heads of both prefill ranks are copied from their /dev/shm files into the decode cache."""
    run = tiny_runs("pd-tp", "trainer.trainer_mode=separate_async",
                    "trainer.async_rollout.max_staleness=0", "rollout.disaggregation.enabled=true",
                    "rollout.nnodes=1", "rollout.n_gpus_per_node=3", "data.val_files=[]",
                    "rollout.disaggregation.prefill_tensor_parallel_size=2",
                    "rollout.disaggregation.kv_transfer=shm")
    assert sorted(run.training) == [1, 2]
    for record in run.training.values():
        # TP sums in another order than the actor: the gap is rounding, of the TP test's size
        assert record["rollout_gap/abs_diff_max"] < 1e-4
        assert record["rollout/kv_transfer_blocks"] > 0
    assert [run.training[step]["weight_version"] for step in (1, 2)] == [1, 2]
