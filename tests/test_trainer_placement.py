"""Where the trainer runs: joining a cluster vs starting Ray, device bundles, placement groups."""

import asyncio
import logging

import pytest
import ray
from ray.util.placement_group import placement_group_table, remove_placement_group

from tandem.config.load import ConfigError, load_config
from tandem.fleet import placement


def test_joins_a_cluster_without_resource_arguments(monkeypatch):
    """Ray refuses num_cpus when connecting to an existing cluster (the old start-up passed it)."""
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.5:6379")
    assert placement.ray_init_kwargs(load_config()) == {"address": "10.0.0.5:6379", "log_to_driver": True,
                                                        "logging_level": logging.WARNING}
    config = load_config(overrides=["trainer.ray_address=auto"])
    assert placement.ray_init_kwargs(config)["address"] == "auto"  # the config wins over the env
    monkeypatch.delenv("RAY_ADDRESS")
    local = placement.ray_init_kwargs(load_config(overrides=["trainer.n_devices=64", "actor.fsdp_size=64",
                                                             "rollout.n=64"]))
    assert local["address"] == "local" and local["num_cpus"] >= 64  # never joins a stray cluster
    monkeypatch.setenv("RAY_ADDRESS", "local")
    assert placement.cluster_address(load_config()) is None


def test_one_bundle_per_device():
    assert placement.device_bundle(load_config()) == {"CPU": 1.0}
    assert placement.device_bundle(load_config(overrides=["model.device=cuda"])) == {"GPU": 1.0, "CPU": 1.0}


def test_unknown_placement_strategy_is_a_config_error():
    with pytest.raises(ConfigError, match="trainer.placement_strategy: unknown value 'SPREAD_OUT'"):
        load_config(overrides=["trainer.placement_strategy=SPREAD_OUT"])


def test_reserves_bundles_and_rendezvous_on_the_bundle_node(ray_cluster):
    config = load_config(overrides=["trainer.n_devices=2", "actor.fsdp_size=2"])

    async def run():
        group = await placement.reserve_devices(config)
        try:
            return placement_group_table(group), await placement.rank0_rendezvous(group)
        finally:
            remove_placement_group(group)

    table, address = asyncio.run(run())
    assert table["strategy"] == "PACK" and len(table["bundles"]) == 2
    assert all(bundle == {"CPU": 1.0} for bundle in table["bundles"].values())
    host, port = address.removeprefix("tcp://").rsplit(":", 1)
    nodes = {node["NodeID"]: node["NodeManagerAddress"] for node in ray.nodes() if node["Alive"]}
    assert host == nodes[table["bundles_to_node_id"][0]] and int(port) > 0


def test_unplaceable_workers_fail_with_the_fields_to_change(ray_cluster):
    """Two bundles on distinct nodes of a one-node cluster: a clear error at once, not a hang."""
    config = load_config(overrides=["trainer.n_devices=2", "actor.fsdp_size=2",
                                    "trainer.placement_strategy=STRICT_SPREAD"])
    with pytest.raises(RuntimeError, match="trainer.n_devices / trainer.placement_strategy.*can "
                                           "never be placed"):
        asyncio.run(placement.reserve_devices(config))
    # the unplaceable group was removed, not left pending in the cluster
    states = [group["state"] for group in placement_group_table().values() if group["strategy"] == "STRICT_SPREAD"]
    assert states and set(states) == {"REMOVED"}
