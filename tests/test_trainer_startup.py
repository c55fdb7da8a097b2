"""Start-up accounting (process start -> first token) and the Ray settings of tandem's own start."""

from __future__ import annotations

import asyncio
import logging
import subprocess
import sys
import time

import pytest
import torch

from tandem.config.load import load_config
from tandem.fleet import placement, startup
from tandem.fleet.startup import MILESTONES, StartupClock
from tandem.types import GenerateRequest


def test_process_start_time_is_when_the_process_began():
    """A child's start lies between the parent's spawning it and the child's answer (a wrong
    /proc field would give a time since boot, decades off)."""
    before = time.time()
    out = subprocess.run([sys.executable, "-c", "import time; from tandem.fleet.startup import "
                          "process_start_time as p; print(repr(p()), repr(time.time()))"],
                         capture_output=True, text=True, check=True, timeout=60)
    after = time.time()
    started, reported_at = map(float, out.stdout.split())
    tick = 0.011  # /proc counts in 10 ms ticks
    assert before - tick <= started <= reported_at <= after


def test_parts_in_the_order_they_happened_and_first_record_stays():
    clock = StartupClock(origin=100.0)
    clock.mark("servers", at=110.0)
    clock.mark("ray", at=103.5)
    clock.mark("trainer", at=101.0)
    clock.mark("ray", at=105.0)  # a second record of a milestone is ignored
    assert list(clock.parts().items()) == [("trainer", 1.0), ("ray", 2.5), ("servers", 6.5)]
    clock = StartupClock(origin=0.0)
    for name, at in (("config", 0.5), ("ray", 2.0), ("trainer", 6.0), ("data", 6.5)):
        clock.mark(name, at=at)
    assert list(clock.parts().items()) == [("config", 0.5), ("ray", 1.5), ("trainer", 4.0),
                                           ("data", 0.5)]
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


def test_early_marks_go_to_the_next_clock_only(monkeypatch):
    monkeypatch.setattr(startup, "_early_marks", {})
    before = time.time()
    startup.mark_early("config")
    marks = StartupClock().marks
    assert list(marks) == ["config"] and before <= marks["config"] <= time.time()
    assert StartupClock().marks == {}  # a later trainer in the same process has no CLI part


def test_engine_stamps_its_first_token():
    from tandem.config.schema import RolloutConfig
    from tandem.models import build_tiny_model
    from tandem.rollout.native import NativeRollout

    rollout = NativeRollout.create(build_tiny_model(), RolloutConfig(kv_cache_memory_bytes=1 << 20))
    assert rollout.stats()["first_token_time"] is None
    before = time.time()

    async def run():
        first = await rollout.generate(GenerateRequest("a", [5, 6, 7], {"temperature": 0, "max_tokens": 3}))
        stamped = rollout.stats()["first_token_time"]
        await rollout.generate(GenerateRequest("b", [5, 6, 7], {"temperature": 0, "max_tokens": 3}))
        await rollout.shutdown()
        return first, stamped

    first, stamped = asyncio.run(run())
    assert len(first.token_ids) == 3 and before <= stamped <= time.time()
    assert rollout.stats()["first_token_time"] == stamped  # the first one, not the latest


def test_local_cluster_start_drops_only_rays_token_auth_notice(monkeypatch, caplog):
    """Ray's own notice (the real function that logs it) is dropped while tandem starts its local
    cluster and shown again afterwards; Ray's other messages pass; a cluster given by address is
    joined with ray.init as it is."""
    auth = pytest.importorskip("ray._private.authentication.authentication_token_setup")
    logger = logging.getLogger(placement.TOKEN_AUTH_LOGGER)
    calls = []

    def init(**kwargs):
        calls.append(kwargs)
        auth._warn_token_auth_enabled()
        logger.warning("something else")

    monkeypatch.setattr(placement.ray, "init", init)
    monkeypatch.setattr(placement, "check_reachable", lambda address: None)  # no probe of 10.0.0.5
    monkeypatch.setattr(placement.ray, "is_initialized", lambda: False)  # the suite's cluster may be up
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    with caplog.at_level(logging.WARNING, logger=placement.TOKEN_AUTH_LOGGER):
        placement.init_ray(load_config())
        assert calls[-1]["address"] == "local"  # a cluster of its own
        assert [r.getMessage() for r in caplog.records] == ["something else"]
        caplog.clear()
        placement.init_ray(load_config(overrides=["trainer.ray_address=10.0.0.5:6379"]))
        assert calls[-1]["address"] == "10.0.0.5:6379"
        assert caplog.records[0].getMessage().startswith(placement.TOKEN_AUTH_NOTICE)


def test_loaded_whole_sees_parameters_the_files_lack(tmp_path):
    from transformers import AutoModelForCausalLM

    from tandem.models import build_tiny_model
    from tandem.fleet.hybrid_worker import loaded_whole

    path = build_tiny_model()
    model = AutoModelForCausalLM.from_pretrained(path)
    assert model.lm_head.weight is model.get_input_embeddings().weight  # tied: one name stored
    assert loaded_whole(model, path)
    model.value_head = torch.nn.Linear(2, 1)  # initialised at random, in no file
    assert not loaded_whole(model, path)
    assert not loaded_whole(model, tmp_path)  # no safetensors there


async def started_worker(config, monkeypatch):
    """A one-rank hybrid worker in this process with its engine started; the versions each
    checkpoint-engine sync was asked for are in worker.synced."""
    from tandem.models.tiny import resolve_model_path
    from tandem.rollout.native import NativeRollout
    from tandem.fleet.hybrid_worker import HybridWorker

    worker = HybridWorker(config)
    worker.synced = []
    sync = worker.checkpoint_engine.sync

    async def spy(stream, rollout, version, partial=False):
        worker.synced.append(version)
        await sync(stream, rollout, version, partial)

    monkeypatch.setattr(worker.checkpoint_engine, "sync", spy)
    await worker.start(NativeRollout, str(resolve_model_path(config.model.path)), config.rollout)
    return worker


async def test_first_sync_is_skipped_only_while_the_actor_is_the_loaded_checkpoint(monkeypatch):
    """A fresh run's first sync (version 0) copies nothing when the engine loaded the same
    files as the actor: the engine then already generates exactly the actor's greedy tokens.
    Any change to the actor before it (here an in-place edit) makes it a real sync."""
    config = load_config(overrides=["model.path=tiny:qwen2", "rollout.kv_cache_memory_bytes=1048576"])
    worker = await started_worker(config, monkeypatch)
    await worker.load_actor_weights(0)
    assert worker.synced == []
    prompt = [5, 6, 7, 8, 9]
    out = await worker.generate(GenerateRequest("a", prompt, {"temperature": 0, "max_tokens": 6}))
    assert out.token_ids == worker.actor_greedy(prompt, len(out.token_ids))
    await worker.load_actor_weights(0)  # only the first sync may be skipped
    assert worker.synced == [0]
    await worker.shutdown()

    changed = await started_worker(config, monkeypatch)
    with torch.no_grad():
        changed.actor.model.get_input_embeddings().weight.mul_(1.5)
    await changed.load_actor_weights(0)
    assert changed.synced == [0]
    out = await changed.generate(GenerateRequest("b", prompt, {"temperature": 0, "max_tokens": 6}))
    assert out.token_ids == changed.actor_greedy(prompt, len(out.token_ids))
    await changed.shutdown()


def test_a_library_run_counts_from_its_own_origin(monkeypatch):
    monkeypatch.setattr(startup, "_early_marks", {})
    startup.set_origin(1000.0)
    try:
        assert not startup.has_early_marks()
        clock = StartupClock()
        clock.mark("ray", at=1003.0)
        assert clock.origin == 1000.0 and clock.parts() == {"ray": 3.0}
    finally:
        startup.set_origin(None)
    assert abs(StartupClock().origin - startup.process_start_time()) < 1.0
