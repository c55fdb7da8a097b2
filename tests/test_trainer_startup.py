"""Start-up accounting (process start -> first token) and the Ray settings of tandem's own start."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time

import pytest

from tandem.config.load import load_config
from tandem.trainer import placement, startup
from tandem.trainer.startup import MILESTONES, StartupClock


def test_process_start_time_is_when_the_process_began():
    """A child's start lies between the parent's spawning it and the child's answer (a wrong
    /proc field would give a time since boot, decades off)."""
    before = time.time()
    out = subprocess.run([sys.executable, "-c", "import time; from tandem.trainer.startup import "
                          "process_start_time as p; print(repr(p()), repr(time.time()))"],
                         capture_output=True, text=True, check=True, timeout=60)
    after = time.time()
    started, reported_at = map(float, out.stdout.split())
    tick = 0.011  # /proc counts in 10 ms ticks
    assert before - tick <= started <= reported_at <= after


def test_parts_in_milestone_order_and_first_record_stays():
    clock = StartupClock(origin=100.0)
    clock.mark("servers", at=110.0)
    clock.mark("ray", at=103.5)
    clock.mark("trainer", at=101.0)
    clock.mark("ray", at=105.0)  # a second record of a milestone is ignored
    assert clock.parts() == {"trainer": 1.0, "ray": 2.5, "servers": 6.5}
    with pytest.raises(ValueError, match="unknown start-up milestone 'raylet'"):
        clock.mark("raylet")


def test_report_once_with_the_earliest_first_token():
    clock = StartupClock(origin=0.0)
    for at, name in enumerate(MILESTONES[:-1], start=1):
        clock.mark(name, at=float(at))
    metrics = clock.report([9.5, 8.25])  # two engines: the earlier token counts
    assert metrics["time/startup"] == 8.25
    assert metrics["time/startup/first_token"] == 8.25 - (len(MILESTONES) - 1)
    assert sum(v for k, v in metrics.items() if k != "time/startup") == pytest.approx(8.25)
    assert set(metrics) == {"time/startup"} | {f"time/startup/{name}" for name in MILESTONES}
    assert "start-up 8.2 s to the first token" in clock.summary()
    assert clock.report([1.0]) == {}


def test_no_first_token_reported():
    clock = StartupClock(origin=0.0)
    clock.mark("ray", at=2.0)
    assert clock.report([]) == {"time/startup/ray": 2.0}
    assert "reports no first-token time" in clock.summary()


def test_early_marks_reach_clocks_started_after_them(monkeypatch):
    monkeypatch.setattr(startup, "_early_marks", {})
    startup.mark_early("config")
    at = startup._early_marks["config"]
    assert StartupClock(origin=at - 1.0).marks == {"config": at}
    assert StartupClock(origin=at + 1.0).marks == {}  # a later run in the same process


def test_engine_stamps_its_first_token():
    from tandem.config.schema import RolloutConfig
    from tandem.models import build_tiny_model
    from tandem.rollout.native import NativeRollout

    rollout = NativeRollout.create(build_tiny_model(), RolloutConfig(kv_cache_memory_bytes=1 << 20))
    assert rollout.stats()["first_token_time"] is None
    before = time.time()

    async def run():
        first = await rollout.generate("a", [5, 6, 7], {"temperature": 0, "max_tokens": 3})
        stamped = rollout.stats()["first_token_time"]
        await rollout.generate("b", [5, 6, 7], {"temperature": 0, "max_tokens": 3})
        await rollout.shutdown()
        return first, stamped

    first, stamped = asyncio.run(run())
    assert len(first.token_ids) == 3 and before <= stamped <= time.time()
    assert rollout.stats()["first_token_time"] == stamped  # the first one, not the latest


def test_local_cluster_keeps_token_auth_on_without_the_warning(monkeypatch):
    """tandem's own local cluster: RAY_AUTH_MODE=token unless the user chose a mode; a cluster
    given by address is joined as it is (its auth mode is its owner's)."""
    calls = []
    monkeypatch.setattr(placement.ray, "init", lambda **kwargs: calls.append(kwargs))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    placement.init_ray(load_config())
    assert "address" not in calls[-1]
    assert placement.os.environ["RAY_AUTH_MODE"] == "token"
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")  # the user's explicit choice stands
    placement.init_ray(load_config())
    assert placement.os.environ["RAY_AUTH_MODE"] == "disabled"
    monkeypatch.delenv("RAY_AUTH_MODE")
    placement.init_ray(load_config(overrides=["trainer.ray_address=10.0.0.5:6379"]))
    assert calls[-1]["address"] == "10.0.0.5:6379" and "RAY_AUTH_MODE" not in placement.os.environ
