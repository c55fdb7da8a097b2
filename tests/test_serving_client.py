"""Client, resumable client and the server's generation gate, in-process (no Ray).

The in-process mode uses the same classes as the Ray path: RolloutServer objects as hybrid
hosts and a plain LoadBalancer, all on the test's event loop.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time

import pytest
import torch

from tandem.config.schema import RolloutConfig
from tandem.rollout import registry
from tandem.serving.manager import ServerManager
from tandem.serving.replica import ControlTimeout, ServerOptions
from tandem.serving.resumable_client import ResumableClient
from tandem.serving.server import RolloutServer
from tandem.types import GenerateRequest, TokenOutput
from test_serving_scripted import load_weights, scripted_sequence, token_log_prob


@pytest.fixture
def scripted(monkeypatch):
    monkeypatch.setitem(registry._ROLLOUT_BACKENDS, "scripted",
                        "test_serving_scripted:ScriptedRollout")


async def local_manager(servers: int = 2, delay: float = 0.002, **server_kwargs) -> ServerManager:
    hosts = [RolloutServer(f"host-{i}", **server_kwargs) for i in range(servers)]
    return await ServerManager.create(RolloutConfig(name="scripted"),
                                      ServerOptions(model_path=f"scripted:delay={delay}"),
                                      "hybrid", hosts=hosts)


def backends(manager: ServerManager) -> list:
    return [server.backend for server in manager.servers.values()]


async def wait_until(condition, timeout_s: float = 5.0) -> None:
    for _ in range(int(timeout_s / 0.01)):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition not reached")


async def test_each_call_gets_a_fresh_backend_id_while_routing_sticks(scripted) -> None:
    manager = await local_manager()
    client = manager.client()
    first = await client.generate(GenerateRequest("conv", [1, 2], {"max_tokens": 3}))
    second = await client.generate(GenerateRequest("conv", [1, 2, *first.token_ids, 9], {"max_tokens": 3}))
    used = [b for b in backends(manager) if b.request_ids]
    assert len(used) == 1  # both turns on the same server
    ids = used[0].request_ids
    assert len(ids) == 2 and ids[0] != ids[1] and all(i.startswith("conv-") for i in ids)
    assert second.extra_fields["min_global_steps"] == second.extra_fields["max_global_steps"] == 0
    assert (await manager.status()).in_flight() == {"replica-0": 0, "replica-1": 0}


async def test_release_happens_on_errors_cancellation_and_timeouts(scripted) -> None:
    manager = await local_manager(delay=0.01)
    client = manager.client()
    with pytest.raises(ValueError, match="non-empty"):
        await client.generate(GenerateRequest("bad", [], {"max_tokens": 3}))
    task = asyncio.ensure_future(client.generate(GenerateRequest("long", [1], {"max_tokens": 10_000})))
    await wait_until(lambda: any(b.stats()["running"] for b in backends(manager)))
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    with pytest.raises(TimeoutError, match="within 0.05 s"):
        await manager.client(timeout_s=0.05).generate(GenerateRequest("slow", [1], {"max_tokens": 10_000}))
    assert sum((await manager.status()).in_flight().values()) == 0
    # The engine stopped the cancelled and timed-out requests instead of running them out.
    assert all(b.stats()["running"] == 0 for b in backends(manager))
    stats = await manager.stats()
    assert sum(s["cancelled"] for s in stats.values()) == 2
    assert sum(s["failed"] for s in stats.values()) == 1


async def test_generate_waits_while_paused_and_proceeds_on_resume(scripted) -> None:
    manager = await local_manager(servers=1)
    client = manager.client()
    running = asyncio.ensure_future(client.generate(GenerateRequest("a", [1], {"max_tokens": 10_000})))
    await wait_until(lambda: backends(manager)[0].stats()["running"] == 1)
    assert sum(sum(n) for n in (await manager.control("abort_all_requests")).results.values()) == 1
    aborted = await running
    assert aborted.stop_reason == "aborted" and aborted.token_ids
    waiting = asyncio.ensure_future(client.generate(GenerateRequest("b", [1], {"max_tokens": 2})))
    await asyncio.sleep(0.1)
    assert not waiting.done()  # the paused server holds the call instead of answering "aborted"
    await manager.control("resume_generation")
    assert (await waiting).stop_reason == "length"


async def test_paused_too_long_is_a_timeout_naming_the_fix(scripted) -> None:
    manager = await local_manager(servers=1, pause_timeout_s=0.1)
    await manager.control("abort_all_requests")
    with pytest.raises(TimeoutError, match="resume_generation"):
        await manager.client().generate(GenerateRequest("a", [1], {"max_tokens": 2}))


async def test_control_calls_refuse_to_run_under_generating_requests(scripted) -> None:
    manager = await local_manager(servers=1)
    task = asyncio.ensure_future(manager.client().generate(GenerateRequest("a", [1], {"max_tokens": 10_000})))
    await wait_until(lambda: backends(manager)[0].stats()["running"] == 1)
    with pytest.raises(RuntimeError, match="abort_all_requests"):
        await manager.control("sleep", ["weights", "kv_cache"])
    with pytest.raises(RuntimeError, match="abort_all_requests"):
        await load_weights(manager, [("w", torch.zeros(2))], 1)
    await manager.control("abort_all_requests")
    await task
    await manager.control("sleep", ["weights", "kv_cache"])
    follow_up = asyncio.ensure_future(manager.client().generate(GenerateRequest("b", [1], {"max_tokens": 2})))
    await manager.control("resume_generation")
    await asyncio.sleep(0.05)
    assert not follow_up.done()  # still asleep: resuming generation is not waking up
    await manager.control("wake_up", ["weights", "kv_cache"])
    assert len((await follow_up).token_ids) == 2


async def test_a_control_verb_reaches_every_server_and_names_an_unknown_one(scripted) -> None:
    manager = await local_manager()
    answers = await manager.control("clear_kv_cache")
    assert answers.results == {"replica-0": [None], "replica-1": [None]} and not answers.left_out
    assert [b.stats()["kv_clears"] for b in backends(manager)] == [1, 1]
    only = await manager.control("clear_kv_cache", replicas=[manager.replicas["replica-1"]])
    assert list(only.results) == ["replica-1"]
    assert [b.stats()["kv_clears"] for b in backends(manager)] == [1, 2]
    assert await manager.weight_versions() == {"replica-0": 0, "replica-1": 0}
    with pytest.raises(ValueError, match="unknown control verb 'reboot'"):
        await manager.control("reboot")
    # weights move only through the seam (fleet/weight_sync.py), never as a verb
    with pytest.raises(ValueError, match="unknown control verb 'update_weights'"):
        await manager.control("update_weights", [("w", torch.zeros(1))], 1)


async def test_a_control_call_without_an_answer_names_the_verb_and_the_server(scripted) -> None:
    manager = await local_manager(servers=2)
    replica = manager.replicas["replica-1"]
    replica.options = dataclasses.replace(replica.options, control_timeout_s=0.2)

    async def stuck(*args):
        await asyncio.sleep(60)

    replica.servers[0].sleep = replica.servers[0].clear_kv_cache = stuck
    started = time.monotonic()
    with pytest.raises(ControlTimeout, match=r"sleep\(\) on server 'replica-1' \(.*\) got no "
                                             r"answer within 0.2 s"):
        await manager.control("sleep", ["kv_cache"])
    assert time.monotonic() - started < 5
    # the weight sync's way: the caller's deadline, the silent replica left out, the fleet kept
    answers = await manager.control("clear_kv_cache", timeout_s=0.2, on_error="leave_out")
    assert answers.results == {"replica-0": [None]} and list(answers.left_out) == ["replica-1"]
    assert "clear_kv_cache() on server 'replica-1'" in str(answers.left_out["replica-1"])
    assert list(manager.replicas) == ["replica-0", "replica-1"]


async def test_resumable_client_continues_across_a_weight_update(scripted) -> None:
    manager = await local_manager(servers=1)
    client = manager.resumable_client()
    params = {"max_tokens": 400, "temperature": 1.0}
    task = asyncio.ensure_future(client.generate(GenerateRequest("traj", [3, 1, 4], params)))
    await wait_until(lambda: backends(manager)[0].stats()["tokens_generated"] >= 5)
    await manager.control("abort_all_requests")
    await load_weights(manager, [("w", torch.zeros(1))], 1)
    before = backends(manager)[0].stats()["tokens_generated"]
    await manager.control("resume_generation")
    out = await task
    assert params == {"max_tokens": 400, "temperature": 1.0}  # caller's dict untouched
    assert len(out.token_ids) == len(out.log_probs) == 400 and out.stop_reason == "length"
    assert out.log_probs == [token_log_prob(t) for t in out.token_ids]
    assert out.extra_fields["resumes"] == 1
    assert (out.extra_fields["min_global_steps"], out.extra_fields["max_global_steps"],
            out.global_steps) == (0, 1, 1)
    # Old-version tokens, then the new version continuing from exactly where it stopped.
    assert out.token_ids[:before] == scripted_sequence([3, 1, 4], before, version=0)
    context = [3, 1, 4, *out.token_ids[:before]]
    assert out.token_ids[before:] == scripted_sequence(context, 400 - before, version=1)
    assert backends(manager)[0].stats()["tokens_generated"] == 400  # none generated twice


async def test_resume_disabled_returns_the_partial_tokens(scripted) -> None:
    manager = await local_manager(servers=1)
    task = asyncio.ensure_future(manager.resumable_client(resume=False).generate(
        GenerateRequest("t", [1], {"max_tokens": 10_000, "logprobs": False})))
    await wait_until(lambda: backends(manager)[0].stats()["tokens_generated"] >= 3)
    await manager.control("abort_all_requests")
    out = await task
    assert out.stop_reason == "aborted" and out.log_probs is None
    assert out.extra_fields["resumes"] == 0 and 3 <= len(out.token_ids) < 10_000


class ScriptedAborts:
    """A client stub answering with canned outputs, recording what it was asked."""

    def __init__(self, outputs: list[TokenOutput]) -> None:
        self.outputs, self.calls = list(outputs), []

    async def generate(self, request) -> TokenOutput:
        request_id, prompt_ids, sampling_params = request.request_id, request.prompt_ids, request.sampling
        self.calls.append((request_id, list(prompt_ids), dict(sampling_params)))
        return self.outputs.pop(0)


async def test_resumable_client_stops_when_an_abort_lands_exactly_on_the_budget() -> None:
    stub = ScriptedAborts([
        TokenOutput([7, 8], [-0.1, -0.2], "aborted", {"global_steps": 2}),
        TokenOutput([], [], "aborted", {"global_steps": 3}),  # aborted before any token
        TokenOutput([9], [-0.3], "aborted", {"global_steps": 4}),
    ])
    out = await ResumableClient(stub).generate(GenerateRequest("r", [1, 2], {"max_tokens": 3}))
    assert [call[1] for call in stub.calls] == [[1, 2], [1, 2, 7, 8], [1, 2, 7, 8]]
    assert [call[2]["max_tokens"] for call in stub.calls] == [3, 1, 1]
    assert {call[0] for call in stub.calls} == {"r"}
    assert (out.token_ids, out.log_probs, out.stop_reason) == ([7, 8, 9], [-0.1, -0.2, -0.3],
                                                               "length")
    # Versions count only where tokens were produced: the empty segment at step 3 does not.
    assert (out.extra_fields["min_global_steps"], out.extra_fields["max_global_steps"]) == (2, 4)
    assert out.version_runs == [[2, 2], [4, 1]]


async def test_resumable_client_joins_version_runs_across_resumes() -> None:
    stub = ScriptedAborts([
        TokenOutput([1, 2, 3], [-0.1] * 3, "aborted", {"global_steps": 5, "min_global_steps": 4,
                                                       "max_global_steps": 5,
                                                       "version_runs": [[4, 1], [5, 2]]}),
        TokenOutput([4, 5], [-0.1] * 2, "aborted", {"global_steps": 5, "version_runs": [[5, 2]]}),
        TokenOutput([6], [-0.1], "length", {"global_steps": 6, "version_runs": [[6, 1]]}),
    ])
    out = await ResumableClient(stub).generate(GenerateRequest("r", [9], {"max_tokens": 6}))
    assert out.version_runs == [[4, 1], [5, 4], [6, 1]]  # the two version-5 runs merge
    assert (out.extra_fields["min_global_steps"], out.extra_fields["max_global_steps"],
            out.global_steps) == (4, 6, 6)


async def test_resumable_client_keeps_versions_a_single_segment_spanned() -> None:
    # An engine that swaps weights under a running request reports min/max itself.
    stub = ScriptedAborts([
        TokenOutput([1, 2], [-0.1, -0.2], "aborted",
                    {"global_steps": 5, "min_global_steps": 4, "max_global_steps": 5}),
        TokenOutput([3], [-0.3], "length", {"global_steps": 6}),
    ])
    out = await ResumableClient(stub).generate(GenerateRequest("r", [9], {"max_tokens": 3}))
    assert (out.extra_fields["min_global_steps"], out.extra_fields["max_global_steps"],
            out.global_steps) == (4, 6, 6)
