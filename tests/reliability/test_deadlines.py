"""Issue 28, "hangs with no deadline": a placement that no node layout can ever hold fails at
once with a message (not after 600 s), a dead trainer.ray_address fails within a bounded time
(Ray itself retries it forever), and a huge buffer_groups neither makes the producer spin nor
piles up tasks in the driver. Issue 35: a training worker that stalls (SIGSTOP) during the
update stops the run within trainer.worker_timeout_s, naming the phase and the worker."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import time

import pytest
import ray

from tandem.agent.dataset import DatasetRow
from tandem.config import ConfigError
from tandem.config.load import load_config
from tandem.demo.tasks import make_datasets
from tandem.serving.placement_fit import placement_problem
from tandem.fleet import placement
from tandem.serving.remote import NoAnswerError
from tandem.trainer.producer import RolloutProducer
from tandem.trainer.rl_trainer import RLTrainer
from tandem.trainer.rollout_buffer import RolloutBuffer
from tandem.trainer.sync import fit_sync

NODE = {"CPU": 4.0, "memory": 8e9, "node:10.0.0.1": 1.0}
GPU_NODE = {"CPU": 8.0, "GPU": 2.0}


@pytest.mark.parametrize("bundles, strategy, nodes, words", [
    ([{"CPU": 1.0}] * 2, "STRICT_SPREAD", [NODE], "only 1 node(s) can take one"),
    ([{"CPU": 1.0}] * 3, "STRICT_SPREAD", [NODE, GPU_NODE], "only 2 node(s)"),
    ([{"CPU": 1.0}] * 5, "STRICT_PACK", [NODE, NODE], "needs one node with {'CPU': 5.0}"),
    ([{"GPU": 1.0, "CPU": 1.0}], "PACK", [NODE], "no node can hold a bundle"),
    ([{"CPU": 3.0}] * 3, "SPREAD", [NODE, NODE], "needs {'CPU': 9.0} in all"),
])
def test_impossible_placements_are_named(bundles, strategy, nodes, words):
    assert words in placement_problem(bundles, strategy, nodes)


@pytest.mark.parametrize("bundles, strategy, nodes", [
    ([{"CPU": 1.0}] * 2, "STRICT_SPREAD", [NODE, NODE]),
    ([{"CPU": 1.0}] * 4, "STRICT_PACK", [NODE]),
    ([{"CPU": 3.0}] * 2, "SPREAD", [NODE, NODE]),  # busy now perhaps, but possible
    ([{"GPU": 1.0, "CPU": 1.0}] * 2, "STRICT_PACK", [NODE, GPU_NODE]),
])
def test_possible_placements_pass(bundles, strategy, nodes):
    assert placement_problem(bundles, strategy, nodes) is None


async def test_strict_spread_over_more_nodes_than_exist_fails_at_once(ray_cluster):
    config = load_config(overrides=["trainer.n_devices=2", "actor.fsdp_size=2",
                                    "trainer.placement_strategy=STRICT_SPREAD"])
    before = {pg_id for pg_id, entry in ray.util.placement_group_table().items()
              if entry["state"] != "REMOVED"}
    # the deadline (600 s) is far beyond the test's own timeout: only failing fast passes
    with pytest.raises(RuntimeError, match="can never be placed: 2 bundle.*STRICT_SPREAD puts each "
                                           "bundle on a node of its own, but only 1 node"):
        await placement.reserve_devices(config)
    after = {pg_id for pg_id, entry in ray.util.placement_group_table().items()
             if entry["state"] != "REMOVED"}
    assert after == before  # the pending group was removed, not left waiting


def closed_port() -> int:
    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()
    return port


def test_a_dead_cluster_address_fails_before_ray_init(monkeypatch):
    port = closed_port()
    config = load_config(overrides=[f"trainer.ray_address=127.0.0.1:{port}"])
    monkeypatch.setattr(ray, "is_initialized", lambda: False)

    def never(**kwargs):
        raise AssertionError("ray.init would retry a dead address forever")
    monkeypatch.setattr(ray, "init", never)
    with pytest.raises(ConnectionError, match=f"nothing answers at 127.0.0.1:{port} within 10 s"):
        placement.init_ray(config)
    with pytest.raises(ConnectionError, match=f"ray://127.0.0.1:{port}"):
        placement.check_reachable(f"ray://127.0.0.1:{port}", timeout_s=1.0)
    placement.check_reachable("auto")  # Ray's to resolve


def test_a_live_address_passes_the_probe():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    try:
        placement.check_reachable(f"127.0.0.1:{server.getsockname()[1]}", timeout_s=5.0)
    finally:
        server.close()


class GatedRunner:
    """run_prompt waits until released; counts calls."""

    def __init__(self) -> None:
        self.gate = asyncio.Event()
        self.calls = 0

    async def run_prompt(self, row, seed=None):
        self.calls += 1
        await self.gate.wait()
        return []


class FakeTrainer:
    def __init__(self, config) -> None:
        self.config = config
        self.step = 0
        self.runner = GatedRunner()
        self.rows_drawn = self.prompt_batch = 0

    def next_prompt_batch(self):
        self.prompt_batch += 1
        return self.prompt_batch - 1

    def train_rows(self, step):
        self.rows_drawn += 1
        return [DatasetRow(messages=[{"role": "user", "content": "?"}], uid=f"{step}-{i}")
                for i in range(self.config.data.train_batch_size)]

    def seeds(self, step, count, validate):
        return list(range(count))


async def test_a_huge_buffer_neither_spins_nor_piles_up_tasks():
    config = load_config(overrides=["rollout.n=4", "rollout.agent_concurrency=8",
                                    "data.train_batch_size=2", "actor.ppo_mini_batch_size=1"])
    trainer = FakeTrainer(config)
    buffer = RolloutBuffer(10**9, on_stale="drop")  # capacity alone, no admission bound
    producer = RolloutProducer(trainer, buffer)
    producer.start()
    for _ in range(2000):  # a spinning producer would submit thousands of groups meanwhile
        await asyncio.sleep(0)
    assert producer.max_generating == 2  # 8 sessions in flight / 4 per group
    assert trainer.runner.calls == 2 and buffer.in_flight == 2 and len(producer._groups) == 2
    assert trainer.rows_drawn <= 2  # at most one batch drawn ahead
    trainer.runner.gate.set()  # groups finish: the producer moves on, still two at a time
    for _ in range(200):
        await asyncio.sleep(0)
    assert len(producer._groups) <= 2 and buffer.depth > 0
    await producer.stop()
    assert buffer.in_flight == 0


def test_a_buffer_larger_than_staleness_allows_is_refused():
    with pytest.raises(ConfigError, match=r"trainer.async_rollout.buffer_groups: is 1000000.*"
                                          r"\(max_staleness \+ 1\) x train_batch_size = 16"):
        load_config(overrides=["trainer.async_rollout.buffer_groups=1000000",
                               "data.train_batch_size=8", "trainer.async_rollout.max_staleness=1"])
    load_config(overrides=["trainer.async_rollout.buffer_groups=16", "data.train_batch_size=8",
                           "trainer.async_rollout.max_staleness=1"])


WORKER_TIMEOUT_S = 5.0


def test_a_stalled_training_worker_stops_the_run_naming_the_phase_and_the_worker(tmp_path,
                                                                                 ray_cluster):
    train, _ = make_datasets(tmp_path / "data", 2, 1, seed=0, kind="easy")
    config = load_config(overrides=[
        "model.path=tiny:qwen2", f"data.train_files=[{train}]", "data.train_batch_size=1",
        "rollout.n=2", "rollout.response_length=4", "rollout.kv_cache_memory_bytes=8388608",
        "actor.ppo_mini_batch_size=1", "trainer.total_steps=1", "trainer.progress=false",
        f"trainer.worker_timeout_s={WORKER_TIMEOUT_S}", f"trainer.output_dir={tmp_path / 'run'}"])
    stalled: dict[str, float] = {}  # when the worker stopped and the run failed; its pid

    async def run() -> None:
        trainer = RLTrainer(config)
        await trainer.start()
        pid = stalled["pid"] = await trainer.workers[0].__ray_call__.remote(
            lambda worker: os.getpid())
        update = trainer.update

        async def update_on_a_stalled_worker(batch):
            os.kill(pid, signal.SIGSTOP)  # alive, answering nothing, as a hung process is
            stalled["at"] = time.monotonic()
            return await update(batch)

        trainer.update = update_on_a_stalled_worker
        try:
            await asyncio.wait_for(fit_sync(trainer), 20 * WORKER_TIMEOUT_S)
        finally:
            stalled["failed_at"] = time.monotonic()
            os.kill(pid, signal.SIGCONT)
            await trainer.stop()

    with pytest.raises(NoAnswerError) as failure:
        asyncio.run(run())
    message = str(failure.value)
    assert stalled["failed_at"] - stalled["at"] < WORKER_TIMEOUT_S + 10  # no hang
    assert "training worker 0 (actor " in message and "trainer.worker_timeout_s" in message
    assert f":{stalled['pid']}) gave no answer" in message  # its node and process
    assert message.startswith(("update_actor: ", "update_actor_on_policy: ")), message
    assert f"within {WORKER_TIMEOUT_S} s" in message


SYNC_TIMEOUT_S = 10.0


@pytest.mark.slow
def test_separate_async_with_its_server_stalled_stops_within_the_sync_deadline(tmp_path,
                                                                              ray_cluster):
    """Issue 42: the one standalone server SIGSTOPped right after the step-1 sync. With
    max_staleness=0 no group of version 1 exists yet, so the trainer waits for trajectories
    (wait_rollout): the run stops within rollout.checkpoint_engine.timeout_s, naming the server
    and the phase, and no clean-up call on the stopped server replaces that error."""
    from test_trainer_sync import tiny_config

    from tandem.trainer.separate_async import fit_separate_async

    config = tiny_config(tmp_path, "trainer.trainer_mode=separate_async", "trainer.total_steps=4",
                         f"rollout.checkpoint_engine.timeout_s={SYNC_TIMEOUT_S}",
                         "trainer.async_rollout.max_staleness=0",
                         "rollout.multi_turn.enable=false", "rollout.multi_turn.tools=[]")
    stalled: dict[str, float] = {}

    async def run() -> None:
        trainer = RLTrainer(config)
        await trainer.start()
        [replica] = trainer.fleet.rollout.replicas.values()
        pid = stalled["pid"] = await replica.servers[0].__ray_call__.remote(
            lambda server: os.getpid())
        sync = trainer.fleet.sync_weights

        async def sync_then_stall(version):
            metrics = await sync(version)
            if version == 1:
                os.kill(pid, signal.SIGSTOP)
                stalled["at"] = time.monotonic()
            return metrics

        trainer.fleet.sync_weights = sync_then_stall
        try:
            await asyncio.wait_for(fit_separate_async(trainer), 20 * SYNC_TIMEOUT_S)
        finally:
            stalled["failed_at"] = time.monotonic()
            os.kill(pid, signal.SIGCONT)
            await trainer.stop()

    with pytest.raises(NoAnswerError) as failure:
        asyncio.run(run())
    message = str(failure.value)
    assert stalled["failed_at"] - stalled["at"] < SYNC_TIMEOUT_S + 8, message
    assert "replica-0" in message and f":{stalled['pid']})" in message, message
    assert f"within {SYNC_TIMEOUT_S} s" in message, message
    assert message.startswith("wait_rollout: no rollout server answered"), message
