"""Replica footprints and replica counts, errors included (no Ray needed)."""

from __future__ import annotations

import pytest

from tandem.config.load import ConfigError
from tandem.config.schema import DisaggregationConfig, RolloutConfig
from tandem.serving.footprint import check_backend_fits, replica_count, replica_world_size
from tandem.serving.manager import ServerManager
from tandem.serving.replica import ServerOptions
from tandem.serving.server import RolloutServer


def test_world_size_is_tp_times_dp() -> None:
    assert replica_world_size(RolloutConfig(name="vllm")) == 1
    assert replica_world_size(RolloutConfig(name="vllm", tensor_model_parallel_size=2,
                                            data_parallel_size=3)) == 6


def test_pipeline_parallel_is_rejected_naming_the_field() -> None:
    with pytest.raises(ConfigError, match="pipeline_model_parallel_size.*Set it to 1"):
        replica_world_size(RolloutConfig(name="vllm", pipeline_model_parallel_size=2))
    with pytest.raises(ConfigError, match="tensor_model_parallel_size.*>= 1"):
        replica_world_size(RolloutConfig(name="vllm", tensor_model_parallel_size=0))


def pd(**kwargs) -> DisaggregationConfig:
    return DisaggregationConfig(enabled=True, **kwargs)


def test_disaggregated_footprint_adds_prefill_and_decode_devices() -> None:
    config = RolloutConfig(name="sglang", disaggregation=pd(
        prefill_tensor_parallel_size=2, decode_tensor_parallel_size=1, decode_replicas=3))
    assert replica_world_size(config) == 2 * 1 + 1 * 3
    assert replica_count(8, replica_world_size(config)) == 1


@pytest.mark.parametrize("config, message", [
    (RolloutConfig(name="native", disaggregation=pd()), "needs rollout.name in"),
    (RolloutConfig(name="vllm", disaggregation=pd(prefill_replicas=2)),
     "prefill_replicas.*exactly 1"),
    (RolloutConfig(name="vllm", data_parallel_size=2, disaggregation=pd()),
     "data_parallel_size.*must be 1"),
    (RolloutConfig(name="vllm", disaggregation=pd(decode_replicas=0)), "decode_replicas.*>= 1"),
    (RolloutConfig(name="vllm", n_gpus_per_node=4, disaggregation=pd(
        prefill_tensor_parallel_size=2, decode_tensor_parallel_size=2, decode_replicas=2)),
     "needs 6 devices but must fit on one node"),
])
def test_disaggregation_constraints(config, message) -> None:
    with pytest.raises(ConfigError, match=message):
        replica_world_size(config)


def test_replica_count_divides_devices_by_footprint() -> None:
    assert replica_count(8, 2) == 4
    assert replica_count(7, 2) == 3
    with pytest.raises(ConfigError, match="1 device.*cannot hold one replica of 2 devices"):
        replica_count(1, 2)


def test_native_engine_is_single_device() -> None:
    check_backend_fits(RolloutConfig(name="native"), 1)
    with pytest.raises(ConfigError, match="single device.*TP=2 x DP=1"):
        check_backend_fits(RolloutConfig(name="native", tensor_model_parallel_size=2), 2)


async def test_manager_rejects_bad_layouts_before_starting_anything() -> None:
    options = ServerOptions("tiny:qwen2")
    with pytest.raises(ConfigError, match="single device"):
        await ServerManager.create(RolloutConfig(tensor_model_parallel_size=2), options, "hybrid",
                                   hosts=[RolloutServer(), RolloutServer()])
    with pytest.raises(ConfigError, match="rollout.nnodes / rollout.n_gpus_per_node"):
        await ServerManager.create(RolloutConfig(), options, "standalone")
    with pytest.raises(ValueError, match="needs `hosts`"):
        await ServerManager.create(RolloutConfig(), options, "hybrid")
    with pytest.raises(ValueError, match="'sideways' is not a valid ReplicaLayout"):
        await ServerManager.create(RolloutConfig(), options, "sideways")
    with pytest.raises(ValueError, match="unknown rollout backend 'nope'"):
        await ServerManager.create(RolloutConfig(name="nope"), options, "hybrid",
                                   hosts=[RolloutServer()])
