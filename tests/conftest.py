"""Shared fixtures. Ray starts only for tests that ask for `ray_cluster` (one per session)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def ray_cluster():
    """One local Ray cluster for the whole session, started on first use, shut down at the end."""
    import ray

    started = not ray.is_initialized()
    if started:
        # worker_niceness 0: Ray's default (15) starves actors whenever the machine is busy.
        ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False,
                 _system_config={"worker_niceness": 0})
    yield ray
    if started:
        ray.shutdown()
