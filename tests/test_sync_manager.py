"""The cross-process sync in one process: the seed's phase order, weights equal to the actor's, the
resumable client across a sync, failure semantics, and the config rules of the layouts.

The transport is `LoopbackEngine`, a test double of the checkpoint-engine contract (queues
between threads of this process instead of a process group); everything else is the product:
a HybridWorker's actor sends, native engines in RolloutServers receive, stage and swap.
The same flow between real processes and the real transports is in test_sync_e2e.py.
"""

from __future__ import annotations

import asyncio
import dataclasses
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
from tandem.fleet.weight_sync import CrossProcessSync
from tandem.fleet.hybrid_worker import HybridWorker
from tandem.fleet.weight_sync import choose_transport
from tandem.weight_sync.base import CheckpointEngine, WeightSyncError
from tandem.weight_sync.registry import register_checkpoint_engine
from tandem.types import GenerateRequest

ROLLOUT = RolloutConfig(kv_cache_memory_bytes=8 << 20, block_size=16)
GREEDY = {"temperature": 0.0, "max_tokens": 10, "ignore_eos": True}
PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [12, 13]]
TIMEOUT_S = 2.0
# delta over shm with two receivers in one process: they share shm's mapping cache (locked)
IN_PROCESS_DELTA = {"transport": "shm"}


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

    def build_topology(self, n_receivers, version, receiver_versions=None, receiver_slots=None):
        plan = super().build_topology(n_receivers, version, receiver_versions, receiver_slots)
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


def cross_process(actor: HybridWorker, servers: ServerManager) -> CrossProcessSync:
    """The cross-process sync from one actor through its configured (loopback) engine."""
    ckpt = actor.config.rollout.checkpoint_engine
    return CrossProcessSync([actor], servers, ckpt.backend, ckpt.timeout_s, ckpt.engine_kwargs)


def make_actor(**checkpoint_engine) -> HybridWorker:
    """A one-rank training worker whose actor starts from the tiny model's weights."""
    config = TandemConfig()
    config.rollout.checkpoint_engine = CheckpointEngineConfig(
        **{"backend": "loopback", "timeout_s": TIMEOUT_S, **checkpoint_engine})
    return HybridWorker(config)


def perturb(actor: HybridWorker, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in actor.actor.model.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator) * 0.3)


async def make_servers(model_path, log: list[str], count: int = 2,
                       rollout: RolloutConfig = ROLLOUT) -> ServerManager:
    """`count` STANDALONE-style replicas whose servers live in this process."""
    options = ServerOptions(model_path=str(model_path))
    manager = ServerManager(rollout, options, ReplicaLayout.STANDALONE, LoadBalancer())
    for rank in range(count):
        replica = RolloutReplica(rank, rollout, options)
        replica.layout = ReplicaLayout.STANDALONE
        server = LoggingServer(replica.server_id, log)
        replica.servers = [server]
        replica.infos = [await server.start(NativeRollout, model_path, rollout)]
        await manager.add_replica(replica)
    return manager


async def close(servers: ServerManager) -> None:
    for replica in servers.replicas.values():
        for server in replica.servers:
            await server.shutdown()


async def greedy(client, prefix: str) -> list:
    return list(await asyncio.gather(*(client.generate(GenerateRequest(f"{prefix}{i}", prompt, GREEDY))
                                       for i, prompt in enumerate(PROMPTS))))


async def fresh_engine_tokens(actor: HybridWorker, tmp_path) -> list[list[int]]:
    actor.actor.model.save_pretrained(tmp_path)
    fresh = NativeRollout.create(tmp_path, ROLLOUT)
    outputs = [await fresh.generate(GenerateRequest(f"f{i}", p, GREEDY)) for i, p in enumerate(PROMPTS)]
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
        GenerateRequest(f"long{i}", PROMPTS[i], {"temperature": 0.0, "max_tokens": budget, "ignore_eos": True})))
        for i in range(2)]
    await until_generating(servers, 4)
    log.clear()  # set-up calls (add_replica may resume generation) are not the sync's
    report = await cross_process(actor, servers).sync(version=1)
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
    manager = cross_process(actor, servers)
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
    report = await cross_process(actor, servers).sync(version=4)
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
        await cross_process(actor, servers).sync(version=1)
    assert failure.value.phase == "load"
    assert await servers.servers_behind(0) == []
    assert all(o.global_steps == 0 for o in await greedy(servers.client(), "after"))
    await close(servers)


def test_auto_picks_shm_on_one_host_and_gloo_or_nccl_across_hosts():
    same = {"replica-0": "node-a", "replica-1": "node-a"}
    split = {"replica-0": "node-a", "replica-1": "node-b"}
    assert choose_transport("auto", "cpu", "node-a", same, {}) == "shm"
    assert choose_transport("auto", "cpu", "node-a", split, {}) == "gloo"
    assert choose_transport("auto", "cuda", "node-a", split, {}) == "nccl"
    assert choose_transport("gloo", "cpu", "node-a", same, {}) == "gloo"
    with pytest.raises(ConfigError, match=r"rollout.checkpoint_engine.backend: shared memory .* "
                                          r"servers replica-1 run on other hosts"):
        choose_transport("shm", "cpu", "node-a", split, {})
    with pytest.raises(ConfigError, match="engine_kwargs.transport: shared memory"):
        choose_transport("delta", "cpu", "node-a", split, {})
    assert choose_transport("delta", "cpu", "node-a", split, {"transport": "gloo"}) == "delta"
    with pytest.raises(ConfigError, match="'naive' hands tensors over inside one process"):
        choose_transport("naive", "cpu", "node-a", same, {})
    # the worker of the hybrid layout builds naive whatever the config names
    assert make_actor().checkpoint_engine.name == "naive"


def test_a_transport_named_for_an_in_process_layout_is_refused_at_load_time():
    with pytest.raises(ConfigError, match=r"rollout.checkpoint_engine.backend: is 'gloo', but "
                                          r"without rollout devices .* set it to auto"):
        load_config(overrides=["rollout.checkpoint_engine.backend=gloo"])
    for backend in ("auto", "naive"):
        load_config(overrides=[f"rollout.checkpoint_engine.backend={backend}"])


async def test_the_cross_process_sync_refuses_hybrid_replicas_and_naive(model_path):
    hybrid = ServerManager(ROLLOUT, ServerOptions(model_path=str(model_path)),
                           ReplicaLayout.HYBRID, LoadBalancer())
    with pytest.raises(ValueError, match="hybrid layout syncs inside each worker"):
        CrossProcessSync([object()], hybrid, "loopback", 1.0)
    standalone = ServerManager(ROLLOUT, ServerOptions(model_path=str(model_path)),
                               ReplicaLayout.STANDALONE, LoadBalancer())
    with pytest.raises(ValueError, match="naive"):
        CrossProcessSync([object()], standalone, "naive", 1.0)


@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf"])
def test_timeout_must_be_a_positive_finite_number(value):
    with pytest.raises(ConfigError, match="rollout.checkpoint_engine.timeout_s"):
        load_config(overrides=[f"rollout.checkpoint_engine.timeout_s={value}"])
    assert load_config(overrides=["rollout.checkpoint_engine.timeout_s=5"]
                       ).rollout.checkpoint_engine.timeout_s == 5.0


class StuckWorker:
    """A hybrid worker whose engine never finishes loading (a hung in-process sync)."""

    def __init__(self, stuck: bool) -> None:
        self.stuck, self.loaded = stuck, []

    async def load_actor_weights(self, version: int) -> None:
        if self.stuck:
            await asyncio.sleep(60)
        self.loaded.append(version)


async def test_the_in_process_sync_has_a_deadline_naming_the_worker():
    from tandem.fleet.weight_sync import InProcessSync

    workers = [StuckWorker(False), StuckWorker(True)]
    sync = InProcessSync(workers, ["hybrid-0", "hybrid-1"], timeout_s=0.3)
    started = time.monotonic()
    with pytest.raises(WeightSyncError) as failure:
        await sync.sync(version=3)
    assert time.monotonic() - started < 5
    assert failure.value.phase == "load" and failure.value.peer == "hybrid worker 1 (hybrid-1)"
    assert "no answer within 0.3 s" in str(failure.value)
    report = await InProcessSync(workers[:1], ["hybrid-0"], timeout_s=1.0).sync(version=4)
    assert report.served == {"hybrid-0": 4} and workers[0].loaded == [3, 4]
    assert set(report.metrics()) == {"sync/load_s", "sync/total_s", "time/sync_inner",
                                     "sync/servers_behind"}


@pytest.mark.parametrize("tp", [1, 2], ids=["one-rank", "tensor-parallel"])
async def test_a_delta_sync_encodes_before_the_pause_and_patches_the_servers_in_place(
        model_path, tmp_path, tp):
    """tensor-parallel: one TP=2 replica whose check reads rank 1's values and whose patches
    are cut per rank (changes in both ranks' slices: vocabulary rows, q_proj rows, o_proj
    columns); current_weight assembles every rank's slice."""
    rollout = dataclasses.replace(ROLLOUT, tensor_model_parallel_size=tp)
    servers = await make_servers(model_path, [], count=2 // tp, rollout=rollout)
    actor = make_actor(backend="delta", timeout_s=10.0, engine_kwargs=IN_PROCESS_DELTA)
    manager = cross_process(actor, servers)
    first = await manager.sync(version=1)  # nothing kept yet: every tensor dense
    embed = "model.embed_tokens.weight"
    served = [replica.servers[0].backend for replica in servers.replicas.values()]
    addresses = [backend.runner.named_parameters()[embed].data_ptr() for backend in served]
    with torch.no_grad():  # a few elements of a dense weight and of packed linears move
        model = actor.actor.model
        model.get_parameter(embed).view(-1)[[3, 500, 901, -7]] += 0.25
        model.get_parameter("model.layers.0.self_attn.q_proj.weight").view(-1)[[7, 8, -2]] -= 0.5
        model.get_parameter("model.layers.1.self_attn.o_proj.weight")[[0, 5], -1] += 0.125
    report = await manager.sync(version=2)
    assert report.behind() == [] and report.left_out == {}
    assert report.timings["sync/encode_s"] > 0.0 and report.timings["sync/pause_s"] > 0.0
    assert report.timings["sync/bytes_moved"] < 0.01 * first.timings["sync/bytes_moved"]
    for backend, address in zip(served, addresses):
        assert backend.runner.named_parameters()[embed].data_ptr() == address  # in place
        for name, tensor in model.state_dict().items():
            if name != "lm_head.weight" or not model.config.tie_word_embeddings:
                assert torch.equal(backend.current_weight(name), tensor), name
    tokens = [output.token_ids for output in await greedy(servers.client(), "delta")]
    assert tokens == await fresh_engine_tokens(actor, tmp_path)
    await close(servers)


async def test_a_failed_delta_sync_leaves_every_server_on_its_weights_and_the_next_is_full(
        model_path, tmp_path):
    servers = await make_servers(model_path, [])
    actor = make_actor(backend="delta", timeout_s=3.0, engine_kwargs=IN_PROCESS_DELTA)
    manager = cross_process(actor, servers)
    await manager.sync(version=1)
    embed = "model.embed_tokens.weight"
    good, drifted = (replica.servers[0].backend for replica in servers.replicas.values())
    with torch.no_grad():  # replica-1 claims version 1 but differs where the update lands
        drifted.runner.named_parameters()[embed].view(-1)[500] += 1.0
    synced = {name: good.current_weight(name) for name in (embed, "model.norm.weight")}
    held = drifted.current_weight(embed)
    with torch.no_grad():
        actor.actor.model.get_parameter(embed).view(-1)[[3, 500]] += 0.25
    with pytest.raises(WeightSyncError, match=f"checksum mismatch for {embed}") as failure:
        await manager.sync(version=2)
    assert ("receiver 2 (replica-1): WeightSyncError: weight sync failed in phase receive"
            in str(failure.value))
    assert await servers.servers_behind(1) == []  # no commit anywhere
    for name, tensor in synced.items():
        assert torch.equal(good.current_weight(name), tensor), name  # patches never applied
    assert torch.equal(drifted.current_weight(embed), held)
    report = await manager.sync(version=3)  # the sender forgot its copy: full, heals the drift
    assert report.behind() == []
    assert report.timings["sync/bytes_moved"] > 0.5 * sum(
        t.numel() * t.element_size() for t in actor.actor.model.state_dict().values())
    for backend in (good, drifted):
        assert torch.equal(backend.current_weight(embed), actor.actor.model.get_parameter(embed))
    await close(servers)
