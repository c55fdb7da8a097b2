"""Shared fixtures. Ray starts only for tests that ask for `ray_cluster` (one per session)."""

from __future__ import annotations

import atexit
import threading

import pytest

# ray.shutdown() can block forever in its GCS subscriber's close (a known Ray flake: a gRPC
# call without deadline; ray-project/ray#44836): give it this long, then kill the cluster.
RAY_SHUTDOWN_TIMEOUT_S = 30.0


@pytest.fixture(scope="session")
def ray_cluster():
    """One local Ray cluster for the whole session, started on first use, shut down at the end."""
    import ray

    started = not ray.is_initialized()
    if started:
        # worker_niceness 0: Ray's default (15) starves actors whenever the machine is busy.
        # address="local": never join a cluster some other process on the machine started
        from tandem.fleet.placement import without_token_auth_notice

        with without_token_auth_notice():  # Ray's token auth stays on, its notice is not shown
            ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False,
                     _system_config={"worker_niceness": 0})
    yield ray
    if started:
        _shutdown_ray(ray)


def _shutdown_ray(ray) -> None:
    """ray.shutdown() with a deadline; past it, kill the cluster's processes (which ends the
    hung gRPC call) and drop Ray's atexit shutdown, which would wait on the same lock."""
    done = threading.Thread(target=ray.shutdown, daemon=True, name="ray-shutdown")
    done.start()
    done.join(RAY_SHUTDOWN_TIMEOUT_S)
    if done.is_alive():
        import warnings

        warnings.warn(f"ray.shutdown() hung for {RAY_SHUTDOWN_TIMEOUT_S} s; killing the cluster")
        node = ray._private.worker._global_node
        if node is not None:
            node.kill_all_processes(check_alive=False, allow_graceful=False)
        atexit.unregister(ray.shutdown)
        done.join(RAY_SHUTDOWN_TIMEOUT_S)


@pytest.fixture(scope="module")
def fleet(ray_cluster, model_path, fleet_config):
    """The cross-process sync tests' fleet (sync_fleet.py): two FSDP2 training ranks built from
    the module's `fleet_config` and two standalone native servers of its `model_path`."""
    import asyncio

    from sync_fleet import ROLLOUT, start_actor
    from tandem.serving.manager import ServerManager
    from tandem.serving.replica import ServerOptions

    workers = start_actor(fleet_config)
    options = ServerOptions(model_path=str(model_path), device_bundle={"CPU": 0.01},
                            start_timeout_s=300)
    servers = asyncio.run(ServerManager.create(ROLLOUT, options, "standalone", total_devices=2))
    yield workers, servers
    asyncio.run(servers.shutdown())
    for worker in workers:
        ray_cluster.kill(worker)
