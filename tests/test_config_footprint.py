"""Replica footprints, replica counts, and the layout options refused at load time because the
fleet would not run them as written (no Ray needed)."""

from __future__ import annotations

import pytest

from tandem.config.footprint import (replica_count, replica_nodes, replica_world_size,
                                     rollout_devices)
from tandem.config.load import ConfigError, load_config
from tandem.config.schema import RolloutConfig
from tandem.serving.manager import ServerManager
from tandem.serving.replica import ServerOptions
from tandem.serving.server import RolloutServer

SEPARATE = ["trainer.trainer_mode=separate_async", "data.train_batch_size=8",
            "actor.ppo_mini_batch_size=8"]
NATIVE_TP2 = ["rollout.tensor_model_parallel_size=2", "rollout.nnodes=1",
              "rollout.n_gpus_per_node=2"]


def test_world_size_is_tensor_times_data_parallel() -> None:
    assert replica_world_size(RolloutConfig(name="vllm")) == 1
    assert replica_world_size(RolloutConfig(name="vllm", tensor_model_parallel_size=2)) == 2


def test_replica_count_divides_devices_by_footprint() -> None:
    assert replica_count(8, 2) == 4
    assert replica_count(7, 2) == 3
    with pytest.raises(ConfigError, match="1 device.*cannot hold one replica of 2 devices"):
        replica_count(1, 2)


@pytest.mark.parametrize("overrides, message", [
    (["rollout.name=sglang", "rollout.disaggregation.enabled=true"],
     r"rollout.disaggregation.kv_transfer: is 'in_process', but SGLang moves KV through its own "
     r"transfer backend \(its disaggregation mode\); set it to mooncake or nixl"),
    (["rollout.name=sglang", "rollout.disaggregation.enabled=true", "rollout.nnodes=1",
      "rollout.n_gpus_per_node=2", "rollout.disaggregation.kv_transfer=mooncake"],
     r"rollout.name: the 'sglang' backend runs on CUDA only"),
    (["rollout.name=sglang", "model.device=cuda", "rollout.disaggregation.enabled=true",
      "rollout.nnodes=1", "rollout.n_gpus_per_node=4", "rollout.disaggregation.kv_transfer=nixl",
      "rollout.disaggregation.prefill_tensor_parallel_size=2"],
     r"rollout.disaggregation.prefill_tensor_parallel_size: is 2, but tandem starts sglang's "
     r"prefill and decode engines with TP 1"),
    (["rollout.name=vllm", "rollout.data_parallel_size=2"],
     r"rollout.data_parallel_size: is 2, but data-parallel engine groups inside a replica run "
     r"on the native engine; the vllm backend's own .* Set it to 1"),
    (["rollout.data_parallel_size=2"],
     r"rollout.data_parallel_size: is 2, but a data-parallel replica needs rollout devices"),
    ([*SEPARATE, *NATIVE_TP2, "rollout.data_parallel_size=2"],
     r"rollout.n_gpus_per_node: a data-parallel replica of 2 engine groups x 2 ranks = 4 "
     r"devices fits on one node, and the node's 2 devices"),
    ([*SEPARATE, *NATIVE_TP2, "rollout.n_gpus_per_node=4", "rollout.data_parallel_size=2",
      "rollout.in_flight_kv=keep"], "a data-parallel replica has no weight slots yet"),
    (["rollout.tensor_model_parallel_size=2"],
     r"rollout.tensor_model_parallel_size: is 2, but without rollout devices of their own"),
    ([*SEPARATE, *NATIVE_TP2, "rollout.pipeline_model_parallel_size=2"],
     r"rollout.pipeline_model_parallel_size: is 2; pipeline parallelism is not supported"),
    (["rollout.name=sglang"], r"rollout.name: the 'sglang' backend runs on CUDA only"),
    (["rollout.name=vllm", "rollout.tensor_model_parallel_size=2"],
     r"rollout.tensor_model_parallel_size: is 2, but without rollout devices of their own each "
     "engine runs inside one training worker"),
    (["rollout.checkpoint_engine.backend=shm"],
     r"rollout.checkpoint_engine.backend: is 'shm', but without rollout devices"),
    ([*SEPARATE, "rollout.name=vllm", "rollout.tensor_model_parallel_size=4",
      "rollout.nnodes=1", "rollout.n_gpus_per_node=2"],
     r"rollout.tensor_model_parallel_size: a replica of 4 devices is wider than a node "
     r"\(rollout.n_gpus_per_node=2\), which only the native engine runs .* with "
     r"rollout.name='vllm' lower it to 2 or less"),
    # a native replica wider than a node: whole nodes, a whole number of replicas
    ([*SEPARATE, "rollout.tensor_model_parallel_size=3", "rollout.nnodes=2",
      "rollout.n_gpus_per_node=2"],
     r"rollout.tensor_model_parallel_size: a replica of 3 devices spans whole nodes of "
     r"rollout.n_gpus_per_node=2; make it a multiple of 2"),
    ([*SEPARATE, "rollout.tensor_model_parallel_size=4", "rollout.nnodes=3",
      "rollout.n_gpus_per_node=2"],
     r"rollout.nnodes: is 3, but each replica spans 2 nodes \(rollout.tensor_model_parallel_size"
     r"=4 / rollout.n_gpus_per_node=2\); make nnodes a multiple of 2"),
    ([*SEPARATE, "rollout.name=vllm", "rollout.tensor_model_parallel_size=2",
      "rollout.nnodes=1", "rollout.n_gpus_per_node=3"],
     r"rollout.n_gpus_per_node: 3 devices per node do not split into replicas of 2 .* 1 would "
     "stay idle"),
    (["rollout.nnodes=1", "rollout.n_gpus_per_node=1", "rollout.checkpoint_engine.backend=naive"],
     r"rollout.checkpoint_engine.backend: is 'naive', .* standalone replicas are processes of "
     "their own"),
    # a replica that fits on one node: nnodes would only size the pool
    (["rollout.nnodes=4", "rollout.n_gpus_per_node=1"],
     r"rollout.nnodes: is 4, but a replica of 1 device\(s\) fits on one node: .* Set "
     r"rollout.nnodes=1 and rollout.n_gpus_per_node to the rollout's devices \(4\)"),
    ([*SEPARATE, "rollout.nnodes=2", "rollout.n_gpus_per_node=2"], r"rollout.nnodes: is 2, but"),
    (["rollout.nnodes=0", "rollout.n_gpus_per_node=2"],
     r"rollout.nnodes: is 0 with rollout.n_gpus_per_node=2: .* set both to 0 \(hybrid\)"),
    (["trainer.trainer_mode=colocate_async", "rollout.nnodes=1"],
     r"rollout.nnodes: is 1 with rollout.n_gpus_per_node=0"),
])
def test_layouts_the_fleet_does_not_build_are_refused_at_load_time(overrides, message) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(overrides=overrides)


def test_what_is_accepted_is_a_layout_the_fleet_builds() -> None:
    hybrid = load_config()
    assert rollout_devices(hybrid) == 0 and hybrid.rollout.checkpoint_engine.backend == "auto"
    # rollout devices of their own make standalone replicas in any trainer mode
    for mode in ("sync", "colocate_async"):
        config = load_config(overrides=[f"trainer.trainer_mode={mode}", "rollout.nnodes=1",
                                        "rollout.n_gpus_per_node=1"])
        assert rollout_devices(config) == 1
    # one pool of several devices: Ray places each replica where its devices are
    assert rollout_devices(load_config(overrides=["rollout.nnodes=1", "rollout.n_gpus_per_node=4"])) == 4
    tensor_parallel = load_config(overrides=[*SEPARATE, "rollout.name=vllm",
                                             "rollout.tensor_model_parallel_size=2",
                                             "rollout.nnodes=1", "rollout.n_gpus_per_node=4"])
    assert replica_count(rollout_devices(tensor_parallel),
                         replica_world_size(tensor_parallel.rollout)) == 2
    # the native engine's ranks: one replica of 2 devices (2 processes of 1 thread on CPU)
    for mode in ("sync", "colocate_async"):
        native = load_config(overrides=[f"trainer.trainer_mode={mode}", *NATIVE_TP2])
        assert replica_count(rollout_devices(native), replica_world_size(native.rollout)) == 1
    native = load_config(overrides=[*SEPARATE, *NATIVE_TP2])
    assert native.rollout.name == "native" and replica_world_size(native.rollout) == 2
    assert replica_nodes(native.rollout) == 1
    # each rank merges its slices of the adapter (docs/engine.md, "Tensor parallelism")
    lora = load_config(overrides=[*SEPARATE, *NATIVE_TP2, "actor.lora.rank=8"])
    assert lora.rollout.lora_rank == 8 and replica_world_size(lora.rollout) == 2
    # per-rank weight slots: double-buffered syncs and kept KV caches across the flip
    slotted = load_config(overrides=[*SEPARATE, *NATIVE_TP2, "rollout.in_flight_kv=keep",
                                     "rollout.checkpoint_engine.engine_kwargs.double_buffer=true"])
    assert slotted.rollout.in_flight_kv == "keep"
    # the seed's world_size: TP x DP devices a replica (rollout/data_parallel.py)
    wide = load_config(overrides=[*SEPARATE, *NATIVE_TP2, "rollout.n_gpus_per_node=8",
                                  "rollout.data_parallel_size=2"])
    assert replica_world_size(wide.rollout) == 4
    assert replica_count(rollout_devices(wide), replica_world_size(wide.rollout)) == 2
    # delta patches cut per rank (test_engine_tensor_parallel.py)
    delta = load_config(overrides=[*SEPARATE, *NATIVE_TP2,
                                   "rollout.checkpoint_engine.backend=delta"])
    assert delta.rollout.checkpoint_engine.backend == "delta"


def test_a_native_replica_wider_than_a_node_spans_whole_nodes() -> None:
    spread = load_config(overrides=[*SEPARATE, "rollout.tensor_model_parallel_size=2",
                                     "rollout.nnodes=2", "rollout.n_gpus_per_node=1"])
    assert replica_nodes(spread.rollout) == 2
    assert replica_count(rollout_devices(spread), replica_world_size(spread.rollout)) == 1
    wide = load_config(overrides=[*SEPARATE, "rollout.tensor_model_parallel_size=4",
                                   "rollout.nnodes=4", "rollout.n_gpus_per_node=2"])
    assert replica_nodes(wide.rollout) == 2
    assert replica_count(rollout_devices(wide), replica_world_size(wide.rollout)) == 2


async def test_manager_rejects_bad_layouts_before_starting_anything() -> None:
    options = ServerOptions("tiny:qwen2")
    with pytest.raises(ConfigError, match="rollout.nnodes / rollout.n_gpus_per_node"):
        await ServerManager.create(RolloutConfig(), options, "standalone")
    with pytest.raises(ValueError, match="needs `hosts`"):
        await ServerManager.create(RolloutConfig(), options, "hybrid")
    with pytest.raises(ValueError, match="'sideways' is not a valid ReplicaLayout"):
        await ServerManager.create(RolloutConfig(), options, "sideways")
    with pytest.raises(ValueError, match="unknown rollout backend 'nope'"):
        await ServerManager.create(RolloutConfig(name="nope"), options, "hybrid",
                                   hosts=[RolloutServer()])
