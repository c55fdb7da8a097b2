"""Where the trainer's processes run: join or start Ray, reserve one placement-group bundle per
training device, and pick the torch.distributed rendezvous on rank 0's node. Imports no torch
at module level, so `tandem train` can start Ray before it imports the rest."""

from __future__ import annotations

import logging
import os
import socket
from contextlib import contextmanager
from typing import Any, Iterator

import ray
from ray.util.placement_group import PlacementGroup

from tandem.config.footprint import reward_devices, rollout_devices
from tandem.config.schema import TandemConfig
from tandem.serving import placement as serving_placement

logger = logging.getLogger(__name__)
PLACEMENT_TIMEOUT_S = 600.0
CONNECT_TIMEOUT_S = 10.0  # Ray itself retries a dead address forever
TOKEN_AUTH_LOGGER = "ray._private.authentication.authentication_token_setup"
TOKEN_AUTH_NOTICE = "Token authentication is enabled for this Ray cluster"


def cluster_address(config: TandemConfig) -> str | None:
    """The cluster to join: trainer.ray_address, else $RAY_ADDRESS, else None (start one;
    "local" also means start one)."""
    address = config.trainer.ray_address or os.environ.get("RAY_ADDRESS") or None
    return None if address == "local" else address


def ray_init_kwargs(config: TandemConfig) -> dict[str, Any]:
    """ray.init() arguments: join an existing cluster as is (no resource arguments, which Ray
    refuses there), or start a local one sized to this machine."""
    address = cluster_address(config)
    # logging_level: Ray's own INFO lines ("Started a local Ray instance...") stay out of the run's output
    if address is not None:
        return {"address": address, "log_to_driver": True, "logging_level": logging.WARNING}
    # worker_niceness 0: Ray's default (15) starves the workers on a busy machine.
    # address "local": a cluster of its own, never the last one `ray start` left on this machine
    return {"address": "local",
            "num_cpus": max(os.cpu_count() or 1, config.trainer.n_devices
                            + rollout_devices(config) + reward_devices(config)),
            "include_dashboard": False, "logging_level": logging.WARNING,
            "log_to_driver": True, "_system_config": {"worker_niceness": 0}}


def init_ray(config: TandemConfig) -> None:
    """Unless Ray is up already: join the configured cluster as it is, or start a local one with
    Ray's own choice of token authentication, without the notice Ray logs about it on every start
    (docs/trainer.md, "Ray's token authentication")."""
    if ray.is_initialized():
        return
    kwargs = ray_init_kwargs(config)
    if cluster_address(config) is not None:
        check_reachable(kwargs["address"])
        ray.init(**kwargs)
        return
    with without_token_auth_notice():
        ray.init(**kwargs)


def check_reachable(address: str, timeout_s: float = CONNECT_TIMEOUT_S) -> None:
    """ConnectionError unless something accepts a TCP connection at a cluster address
    ("host:port", "ray://host:port"; "auto" is Ray's to resolve) within timeout_s."""
    if address == "auto":
        return
    host, _, port = address.removeprefix("ray://").rpartition(":")
    host, port = (host, port) if port.isdigit() else (address.removeprefix("ray://"), "6379")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except OSError as error:
        raise ConnectionError(f"trainer.ray_address / RAY_ADDRESS={address!r}: nothing answers at "
                              f"{host}:{port} within {timeout_s:g} s ({error}); start the cluster "
                              "(`ray start --head`), fix the address, or leave it empty to start a "
                              "local cluster") from None


@contextmanager
def without_token_auth_notice() -> Iterator[None]:
    """Drop Ray's "token authentication is enabled for this Ray cluster" notice (only that
    line) while a local cluster starts. Setting RAY_AUTH_MODE here instead is no option: Ray
    reads it when imported, and a driver and cluster that disagree on it cannot connect."""
    notice = logging.getLogger(TOKEN_AUTH_LOGGER)

    def keep(record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(TOKEN_AUTH_NOTICE)

    notice.addFilter(keep)
    try:
        yield
    finally:
        notice.removeFilter(keep)


def torch_threads(config: TandemConfig, cores: int | None = None) -> tuple[int, int]:
    """(torch threads of each training worker, of each standalone rollout server): a set value
    (actor.torch_threads, rollout.torch_threads) is used as is; 0 ("auto") gives each process that
    computes at the same time (the workers, and the standalone servers if any) an even share of the
    `cores` the set values leave."""
    cores = cores or len(os.sched_getaffinity(0))
    workers, servers = config.trainer.n_devices, rollout_devices(config)
    actor, rollout = config.actor.torch_threads, config.rollout.torch_threads
    unset = (0 if actor else workers) + (0 if rollout or not servers else servers)
    share = max(1, (cores - workers * actor - servers * rollout) // max(unset, 1))
    return actor or share, rollout or share


def log_torch_threads(config: TandemConfig, hybrid: list[dict[str, int]], manager: Any) -> None:
    """Log once the torch threads each process reports (`hybrid`: every worker's engine and
    training threads; every standalone server's engine thread); warn when the processes
    computing at the same time ask for more threads than this machine has cores."""
    training = [threads["training"] for threads in hybrid]
    separate = rollout_devices(config) > 0
    if separate:
        engines = [info.torch_threads for replica in manager.replicas.values() for info in replica.infos]
    else:
        engines = [threads["engine"] for threads in hybrid]
    cores = len(os.sched_getaffinity(0))
    logger.info("torch threads (%d cores here, trainer_mode=%s): training %s, rollout engines %s; %s",
                cores, config.trainer.trainer_mode, training, engines,
                "standalone replicas beside the workers" if separate
                else "each worker alternates generation and training")
    busy = sum(training) + (sum(engines) if separate else 0)
    if busy > cores and cluster_address(config) is None:  # on a cluster the processes spread over nodes
        logger.warning("%d torch threads compute at the same time on %d cores: OpenMP threads will "
                       "preempt each other; lower actor.torch_threads / rollout.torch_threads", busy, cores)


def device_bundle(config: TandemConfig) -> dict[str, float]:
    """Ray resources of one training device: a CPU, or a GPU with the CPU that drives it."""
    return serving_placement.device_bundle(config.model.device)


async def reserve_devices(config: TandemConfig) -> PlacementGroup:
    """A placement group of trainer.n_devices bundles (trainer.placement_strategy), placed;
    removed again if it cannot be placed in time."""
    n, strategy = config.trainer.n_devices, config.trainer.placement_strategy
    return await serving_placement.reserve(
        [device_bundle(config)] * n, strategy, PLACEMENT_TIMEOUT_S,
        f"training workers ({n} x {device_bundle(config)}, {strategy}; trainer.n_devices / "
        "trainer.placement_strategy)")


@ray.remote(num_cpus=0)
def _address_on_node() -> str:
    from tandem.training.fsdp import rendezvous_address

    return rendezvous_address()


async def rank0_rendezvous(group: PlacementGroup) -> str:
    """tcp://<node ip>:<free port> chosen on the node of bundle 0, where rank 0 will run."""
    return await _address_on_node.options(**serving_placement.in_bundle(group, 0, {})).remote()
