"""Where the trainer's processes run: join or start Ray, reserve one placement-group bundle per
training device, and pick the torch.distributed rendezvous on rank 0's node."""

from __future__ import annotations

import os
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from tandem.config.schema import TandemConfig
from tandem.serving.replica import actor_resources, resolve_ready
from tandem.training.fsdp import rendezvous_address

PLACEMENT_TIMEOUT_S = 600.0


def cluster_address(config: TandemConfig) -> str | None:
    """The cluster to join: trainer.ray_address, else $RAY_ADDRESS, else None (start one)."""
    return config.trainer.ray_address or os.environ.get("RAY_ADDRESS") or None


def ray_init_kwargs(config: TandemConfig) -> dict[str, Any]:
    """ray.init() arguments: join an existing cluster as is (no resource arguments, which Ray
    refuses there), or start a local one sized to this machine."""
    address = cluster_address(config)
    if address is not None:
        return {"address": address, "log_to_driver": True}
    # worker_niceness 0: Ray's default (15) starves the workers on a busy machine.
    return {"num_cpus": max(os.cpu_count() or 1, config.trainer.n_devices + standalone_rollout_devices(config)),
            "include_dashboard": False,
            "log_to_driver": True, "_system_config": {"worker_niceness": 0}}


def init_ray(config: TandemConfig) -> None:
    """Join the configured cluster as it is, or start a local one with Ray's token
    authentication on: RAY_AUTH_MODE=token unless the environment already chooses a mode
    (Ray >= 2.59 turns it on for a new local cluster anyway, and warns on every start while
    the mode is left unset; docs/trainer.md, "Ray's token authentication")."""
    kwargs = ray_init_kwargs(config)
    if "address" not in kwargs:
        os.environ.setdefault("RAY_AUTH_MODE", "token")
    ray.init(**kwargs)


def standalone_rollout_devices(config: TandemConfig) -> int:
    """Devices of the standalone rollout replicas (separate_async only; else 0)."""
    if config.trainer.trainer_mode != "separate_async":
        return 0
    return config.rollout.nnodes * config.rollout.n_gpus_per_node


def device_bundle(config: TandemConfig) -> dict[str, float]:
    """Ray resources of one training device: a CPU, or a GPU with the CPU that drives it."""
    return {"GPU": 1.0, "CPU": 1.0} if config.model.device.startswith("cuda") else {"CPU": 1.0}


async def reserve_devices(config: TandemConfig) -> PlacementGroup:
    """A placement group of trainer.n_devices bundles (trainer.placement_strategy), placed;
    removed again if it cannot be placed in time."""
    n = config.trainer.n_devices
    group = placement_group([device_bundle(config)] * n, strategy=config.trainer.placement_strategy)
    try:
        await resolve_ready(group, PLACEMENT_TIMEOUT_S,
                            f"training workers ({n} x {device_bundle(config)}, "
                            f"{config.trainer.placement_strategy}; trainer.n_devices / "
                            "trainer.placement_strategy)")
    except BaseException:
        remove_placement_group(group)  # a pending group would wait for resources forever
        raise
    return group


def in_bundle(group: PlacementGroup, index: int, resources: dict[str, float]) -> dict[str, Any]:
    """Ray .options() that run an actor or task on bundle `index` of `group` with `resources`."""
    strategy = PlacementGroupSchedulingStrategy(placement_group=group,
                                                placement_group_bundle_index=index)
    return {"scheduling_strategy": strategy, **actor_resources(resources)}


@ray.remote(num_cpus=0)
def _address_on_node() -> str:
    return rendezvous_address()


async def rank0_rendezvous(group: PlacementGroup) -> str:
    """tcp://<node ip>:<free port> chosen on the node of bundle 0, where rank 0 will run."""
    return await _address_on_node.options(**in_bundle(group, 0, {})).remote()
