"""Issue 17, threads: each process's torch thread count from the cores it owns (hybrid: the
worker's engine and its training alternate, so both take all of them; separate_async: training
and the standalone servers run at once and split them), set against Ray's OMP_NUM_THREADS=1."""

from __future__ import annotations

import os
import sys

import pytest
import ray

from tandem.config.load import ConfigError, load_config
from tandem.fleet.hybrid_worker import HybridWorkerActor
from tandem.fleet.placement import torch_threads

# the lambda below runs inside the worker, which cannot import this test module
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
SEPARATE = ["trainer.trainer_mode=separate_async", "rollout.nnodes=1", "rollout.n_gpus_per_node=1",
            "rollout.checkpoint_engine.backend=shm", "data.train_batch_size=8"]


def test_auto_threads_give_each_concurrent_process_its_share_of_the_cores():
    # hybrid: one worker per device, its engine alternating with training in the same process
    assert torch_threads(load_config(), cores=16)[0] == 16
    assert torch_threads(load_config(overrides=["trainer.n_devices=2", "actor.fsdp_size=2"]), cores=16)[0] == 8
    # separate_async: 1 training worker and 1 standalone server compute at the same time
    assert torch_threads(load_config(overrides=SEPARATE), cores=16) == (8, 8)
    # a set count is kept; auto takes what it leaves
    assert torch_threads(load_config(overrides=SEPARATE + ["actor.torch_threads=4"]), cores=16) == (4, 12)
    assert torch_threads(load_config(overrides=SEPARATE + ["rollout.torch_threads=10"]), cores=16) == (6, 10)
    assert torch_threads(load_config(overrides=SEPARATE + ["actor.torch_threads=3", "rollout.torch_threads=5"]),
                         cores=16) == (3, 5)
    # never below one thread, even with more processes than cores
    assert torch_threads(load_config(overrides=["trainer.n_devices=4", "actor.fsdp_size=4"]), cores=2)[0] == 1
    assert torch_threads(load_config(overrides=SEPARATE + ["actor.torch_threads=8"]), cores=2) == (8, 1)


def test_rollout_threads_outside_separate_async_are_a_config_error():
    with pytest.raises(ConfigError, match=r"rollout.torch_threads: is 2, but in trainer_mode=sync the rollout "
                                          r"engine runs inside the training workers, whose threads are "
                                          r"actor.torch_threads; set rollout.torch_threads=0"):
        load_config(overrides=["rollout.torch_threads=2"])
    with pytest.raises(ConfigError, match=r"actor.torch_threads: is -1; must be >= 0"):
        load_config(overrides=["actor.torch_threads=-1"])
    assert load_config(overrides=SEPARATE + ["rollout.torch_threads=2"]).rollout.torch_threads == 2


def test_hybrid_worker_trains_and_generates_on_all_its_threads(ray_cluster):
    """A worker on a 1-CPU bundle, where Ray sets OMP_NUM_THREADS=1, told to use 2 threads: the
    engine's thread (the event loop's) and the training thread both run 2, before and after a
    training-side call."""
    config = load_config(overrides=["model.path=tiny:qwen2"])
    worker = HybridWorkerActor.options(num_cpus=1).remote(config, 0, 1, None, 10, None, 2)
    try:
        assert ray.get(worker.__ray_call__.remote(lambda _: os.environ.get("OMP_NUM_THREADS"))) == "1"
        assert ray.get(worker.torch_threads.remote(), timeout=300) == {"engine": 2, "training": 2}
        out = ray.get(worker.compute_log_prob.remote(_batch()))
        assert out["log_probs"].shape == (5,)
        assert ray.get(worker.torch_threads.remote()) == {"engine": 2, "training": 2}
    finally:
        ray.kill(worker)


def _batch():
    import torch

    from tandem.batch.jagged import trajectories_to_batch
    from tandem.batch.trajectory import Trajectory

    return trajectories_to_batch([Trajectory(prompts=torch.tensor([5, 6, 7]), responses=torch.tensor([8, 9, 10, 11, 12]),
                                             response_mask=torch.ones(5, dtype=torch.long),
                                             rollout_log_probs=torch.zeros(5), min_global_steps=0,
                                             max_global_steps=0)])
