"""The sync manager in one process: the seed's phase order, weights equal to the actor's, the
resumable client across a sync, failure semantics, and the config rules of the layouts.

The transport is `LoopbackEngine`, a test double of the checkpoint-engine contract (queues
between threads of this process instead of a process group); everything else is the product:
a HybridWorker's actor sends, native engines in RolloutServers receive, stage and swap.
The same flow between real processes and the real transports is in test_sync_e2e.py.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import time
import uuid

import pytest
import torch

from tandem.config.load import ConfigError, load_config
from tandem.config.schema import CheckpointEngineConfig, RolloutConfig, TandemConfig
from tandem.rollout.native import NativeRollout
from tandem.serving.balancer import LoadBalancer
from tandem.serving.manager import ServerManager
from tandem.serving.replica import ReplicaLayout, RolloutReplica, ServerOptions
from tandem.serving.server import RolloutServer
from tandem.trainer.hybrid_worker import HybridWorker
from tandem.weight_sync.base import CheckpointEngine, WeightSyncError
from tandem.weight_sync.manager import WeightSyncManager
from tandem.weight_sync.participants import checkpoint_engine_name
from tandem.weight_sync.registry import register_checkpoint_engine

ROLLOUT = RolloutConfig(kv_cache_memory_bytes=8 << 20, block_size=16)
GREEDY = {"temperature": 0.0, "max_tokens": 10, "ignore_eos": True}
PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [12, 13]]
TIMEOUT_S = 2.0


class LoopbackEngine(CheckpointEngine):
    """Test double of a transport: the sender puts copies of each tensor on one queue per
    receiver. stop_after=k: the sender raises after k tensors (a sender dying mid-transfer)."""

    name = "loopback"
    channels: dict[str, list[queue.Queue]] = {}
    plans: list = []

    def __init__(self, bucket_megabytes: int = 512, timeout_s: float = 300.0,
                 stop_after: int | None = None) -> None:
        super().__init__(bucket_megabytes, timeout_s)
        self.stop_after = stop_after

    def build_topology(self, n_receivers, version, receiver_versions=None):
        plan = super().build_topology(n_receivers, version, receiver_versions)
        channel = uuid.uuid4().hex
        self.channels[channel] = [queue.Queue() for _ in range(n_receivers)]
        plan = dataclasses.replace(plan, details={"channel": channel,
                                                  "receiver_versions": receiver_versions})
        self.plans.append(plan)
        return plan

    async def send_weights(self, named_tensors) -> None:
        queues = self.channels[self.plan.details["channel"]]
        for index, (name, tensor) in enumerate(named_tensors):
            if index == self.stop_after:
                raise WeightSyncError("send", None, f"sender stopped after {index} tensors")
            for receiver in queues:
                receiver.put((name, tensor.clone()))
        for receiver in queues:
            receiver.put(None)

    def receive_weights(self):
        receiver = self.channels[self.plan.details["channel"]][self.rank - 1]
        while True:
            try:
                item = receiver.get(timeout=self.timeout_s)
            except queue.Empty:
                raise WeightSyncError("receive", "sender", f"nothing within {self.timeout_s} s")
            if item is None:
                return
            yield item


register_checkpoint_engine("loopback", f"{__name__}:LoopbackEngine")


class LoggingServer(RolloutServer):
    """A RolloutServer that records the sync calls it gets, in order, in a shared log."""

    def __init__(self, server_id: str, log: list[str]) -> None:
        super().__init__(server_id, pause_timeout_s=60.0, drain_timeout_s=10.0)
        self.log = log

    def __getattribute__(self, name):
        if name in ("abort_all_requests", "release_kv_cache", "receive_weights",
                    "resume_kv_cache", "resume_generation"):
            object.__getattribute__(self, "log").append(
                f"{object.__getattribute__(self, 'server_id')}:{name}")
        return object.__getattribute__(self, name)


@pytest.fixture(scope="module")
def model_path():
    from tandem.models import build_tiny_model

    return build_tiny_model()


def make_actor(**checkpoint_engine) -> HybridWorker:
    """A one-rank training worker whose actor starts from the tiny model's weights."""
    config = TandemConfig()
    config.rollout.checkpoint_engine = CheckpointEngineConfig(
        backend="loopback", timeout_s=TIMEOUT_S, **checkpoint_engine)
    return HybridWorker(config)


def perturb(actor: HybridWorker, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in actor.actor.model.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator) * 0.3)


async def make_servers(model_path, log: list[str], count: int = 2) -> ServerManager:
    """`count` STANDALONE-style replicas whose servers live in this process."""
    options = ServerOptions(model_path=str(model_path))
    manager = ServerManager(ROLLOUT, options, ReplicaLayout.STANDALONE, LoadBalancer())
    for rank in range(count):
        replica = RolloutReplica(rank, ROLLOUT, options)
        replica.layout = ReplicaLayout.STANDALONE
        server = LoggingServer(replica.server_id, log)
        replica.servers = [server]
        replica.infos = [await server.start(NativeRollout, model_path, ROLLOUT)]
        await manager.add_replica(replica)
    return manager


async def close(servers: ServerManager) -> None:
    for replica in servers.replicas.values():
        for server in replica.servers:
            await server.shutdown()


async def greedy(client, prefix: str) -> list:
    return list(await asyncio.gather(*(client.generate(f"{prefix}{i}", prompt, GREEDY)
                                       for i, prompt in enumerate(PROMPTS))))


async def fresh_engine_tokens(actor: HybridWorker, tmp_path) -> list[list[int]]:
    actor.actor.model.save_pretrained(tmp_path)
    fresh = NativeRollout.create(tmp_path, ROLLOUT)
    outputs = [await fresh.generate(f"f{i}", p, GREEDY) for i, p in enumerate(PROMPTS)]
    await fresh.shutdown()
    return [output.token_ids for output in outputs]


async def until_generating(servers: ServerManager, tokens: int) -> None:
    deadline = time.monotonic() + 30
    while sum(s["backend"]["generated_tokens"] for s in (await servers.stats()).values()) < tokens:
        assert time.monotonic() < deadline, f"fewer than {tokens} tokens generated in 30 s"
        await asyncio.sleep(0.002)


async def test_sync_runs_the_seed_order_and_serves_the_actor_weights(model_path, tmp_path):
    log: list[str] = []
    servers = await make_servers(model_path, log)
    actor = make_actor()
    perturb(actor, seed=1)
    client = servers.resumable_client()
    budget = 60
    in_flight = [asyncio.create_task(client.generate(
        f"long{i}", PROMPTS[i], {"temperature": 0.0, "max_tokens": budget, "ignore_eos": True}))
        for i in range(2)]
    await until_generating(servers, 4)
    log.clear()  # set-up calls (add_replica may resume generation) are not the sync's
    report = await WeightSyncManager([actor], servers, actor.config.rollout.checkpoint_engine
                                     ).sync(version=1)
    for server in ("replica-0", "replica-1"):
        assert [entry.split(":")[1] for entry in log if entry.startswith(server)] == [
            "abort_all_requests", "release_kv_cache", "receive_weights", "resume_kv_cache",
            "resume_generation"]
    assert LoopbackEngine.plans[-1].details["receiver_versions"] == [0, 0]
    assert report.served == {"replica-0": 1, "replica-1": 1} and report.behind() == []
    assert await servers.servers_behind(1) == [] and await servers.servers_behind(2) == [
        "replica-0", "replica-1"]
    for phase in ("abort", "release_kv_cache", "build_topology", "transfer", "init_process_group",
                  "receive", "load", "send", "finalize", "resume_kv_cache", "resume_generation",
                  "total"):
        assert report.timings[f"sync/{phase}_s"] >= 0.0, phase
    finished = await asyncio.gather(*in_flight)
    for output in finished:
        assert len(output.token_ids) == budget and len(output.log_probs) == budget
        assert output.extra_fields["min_global_steps"] == 0
        assert output.extra_fields["max_global_steps"] == 1 and output.global_steps == 1
    served = await greedy(servers.client(), "after")
    assert [output.token_ids for output in served] == await fresh_engine_tokens(actor, tmp_path)
    assert all(output.global_steps == 1 for output in served)
    await close(servers)


async def test_a_sender_dying_mid_transfer_leaves_every_server_on_its_version(model_path):
    servers = await make_servers(model_path, [])
    before = [output.token_ids for output in await greedy(servers.client(), "before")]
    actor = make_actor(engine_kwargs={"stop_after": 5})
    perturb(actor, seed=2)
    manager = WeightSyncManager([actor], servers, actor.config.rollout.checkpoint_engine)
    start = time.monotonic()
    with pytest.raises(WeightSyncError) as failure:
        await manager.sync(version=1)
    # the receivers waited TIMEOUT_S for the next tensor, not forever
    assert time.monotonic() - start < 10 * TIMEOUT_S
    error = failure.value
    assert error.phase == "send" and "sender rank 0" in str(error)
    assert "receiver 1 (replica-0): WeightSyncError" in str(error)
    assert "receiver 2 (replica-1): WeightSyncError" in str(error)
    assert await servers.servers_behind(0) == []
    after = await greedy(servers.client(), "after")  # generation resumed, old weights
    assert [o.token_ids for o in after] == before and all(o.global_steps == 0 for o in after)
    actor._sync_engine.stop_after = None  # the sender is kept across syncs; now it sends all
    report = await manager.sync(version=1)
    assert report.behind() == [] and report.left_out == {}
    assert [o.token_ids for o in await greedy(servers.client(), "next")] != before
    await close(servers)


async def test_a_server_that_cannot_take_part_is_left_out_and_reported(model_path):
    servers = await make_servers(model_path, [])
    dead = servers.replicas["replica-1"].servers[0]
    await dead.shutdown()  # its generation gate stays closed: abort succeeds, then ...

    async def gone(*args):
        raise ConnectionError("server process died")

    dead.release_kv_cache = gone
    actor = make_actor()
    perturb(actor, seed=3)
    report = await WeightSyncManager([actor], servers, actor.config.rollout.checkpoint_engine
                                     ).sync(version=4)
    assert list(report.left_out) == ["replica-1"]
    assert "release_kv_cache: ConnectionError: server process died" in report.left_out["replica-1"]
    assert report.served["replica-0"] == 4 and report.behind() == ["replica-1"]
    await close(servers)


async def test_a_receiver_rejecting_a_tensor_keeps_the_old_version_everywhere(model_path):
    servers = await make_servers(model_path, [])
    actor = make_actor()
    with torch.no_grad():
        next(actor.actor.model.parameters()).fill_(float("nan"))
    with pytest.raises(WeightSyncError, match="NaN or inf") as failure:
        await WeightSyncManager([actor], servers, actor.config.rollout.checkpoint_engine
                                ).sync(version=1)
    assert failure.value.phase == "load"
    assert await servers.servers_behind(0) == []
    assert all(o.global_steps == 0 for o in await greedy(servers.client(), "after"))
    await close(servers)


def test_hybrid_is_forced_to_naive_and_a_separate_process_never_is(caplog):
    with caplog.at_level(logging.WARNING):
        assert checkpoint_engine_name(CheckpointEngineConfig(backend="loopback"), hybrid=True) \
            == "naive"
    assert "rollout.checkpoint_engine.backend='loopback' is ignored" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        assert checkpoint_engine_name(CheckpointEngineConfig(), hybrid=True) == "naive"
    assert caplog.text == ""
    with pytest.raises(ConfigError, match=r"rollout.checkpoint_engine.backend: 'naive' .* set it "
                                          r"to one of: .*loopback"):
        checkpoint_engine_name(CheckpointEngineConfig(backend="naive"), hybrid=False)
    assert checkpoint_engine_name(CheckpointEngineConfig(backend="loopback"), hybrid=False) \
        == "loopback"
    # the worker of the hybrid layout builds naive whatever the config names
    assert make_actor().checkpoint_engine.name == "naive"


async def test_the_manager_refuses_hybrid_replicas_and_naive(model_path):
    hybrid = ServerManager(ROLLOUT, ServerOptions(model_path=str(model_path)),
                           ReplicaLayout.HYBRID, LoadBalancer())
    with pytest.raises(ValueError, match="hybrid layout syncs inside each worker"):
        WeightSyncManager([object()], hybrid, CheckpointEngineConfig(backend="loopback"))
    standalone = ServerManager(ROLLOUT, ServerOptions(model_path=str(model_path)),
                               ReplicaLayout.STANDALONE, LoadBalancer())
    with pytest.raises(ConfigError, match="naive"):
        WeightSyncManager([object()], standalone, CheckpointEngineConfig())


@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf"])
def test_timeout_must_be_a_positive_finite_number(value):
    with pytest.raises(ConfigError, match="rollout.checkpoint_engine.timeout_s"):
        load_config(overrides=[f"rollout.checkpoint_engine.timeout_s={value}"])
    assert load_config(overrides=["rollout.checkpoint_engine.timeout_s=5"]
                       ).rollout.checkpoint_engine.timeout_s == 5.0
