"""Placing processes on Ray devices, one way for every pool: a device's bundle, a placement group
reserved within a deadline (an impossible one refused at once: serving/placement_fit.py), and
the actor options that run a process on one bundle of it. Rollout replicas, reward pools and
the training workers (fleet/placement.py) all place through here."""

from __future__ import annotations

import asyncio
from typing import Any, Sequence

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from tandem.serving.placement_fit import alive_nodes, placement_problem


def device_bundle(device: str, cpus: float = 1.0) -> dict[str, float]:
    """Ray resources of one device: a GPU with the CPU that drives it on cuda, `cpus` CPUs
    otherwise."""
    return {"CPU": 1.0, "GPU": 1.0} if device.startswith("cuda") else {"CPU": float(cpus)}


def actor_resources(resources: dict[str, float]) -> dict[str, Any]:
    """Ray actor options asking for exactly `resources`."""
    custom = {k: v for k, v in resources.items() if k not in ("CPU", "GPU")}
    return {"num_cpus": resources.get("CPU", 0), "num_gpus": resources.get("GPU", 0),
            **({"resources": custom} if custom else {})}


def in_bundle(group: PlacementGroup, index: int, resources: dict[str, float]) -> dict[str, Any]:
    """Ray .options() that run an actor or task on bundle `index` of `group` with `resources`."""
    strategy = PlacementGroupSchedulingStrategy(placement_group=group,
                                                placement_group_bundle_index=index)
    return {"scheduling_strategy": strategy, **actor_resources(resources)}


async def reserve(bundles: Sequence[dict[str, float]], strategy: str, timeout_s: float,
                  what: str) -> PlacementGroup:
    """A placement group of `bundles`, placed; removed again (a pending group would wait for
    resources forever) when it can never be placed or is not placed within timeout_s."""
    group = placement_group(list(bundles), strategy=strategy)
    try:
        await wait_placed(group, timeout_s, what)
    except BaseException:
        remove_placement_group(group)
        raise
    return group


async def wait_placed(group: PlacementGroup, timeout_s: float, what: str) -> None:
    """Wait for `group` to be placed; a RuntimeError at once when the cluster's nodes can never
    hold it, a TimeoutError naming `what` after timeout_s."""
    strategy = ray.util.placement_group_table(group).get("strategy", "PACK")
    problem = placement_problem(group.bundle_specs, strategy, alive_nodes())
    if problem:
        raise RuntimeError(f"{what}: the placement group can never be placed: {problem}")
    try:
        await asyncio.wait_for(asyncio.wrap_future(group.ready().future()), timeout_s)
    except asyncio.TimeoutError:
        raise TimeoutError(f"{what}: placement group not placed within {timeout_s} s; the cluster "
                           f"has {ray.available_resources()} available") from None
