"""The runner: n sessions per prompt, bounded concurrency, sticky ids, reward hook, errors."""

import asyncio

import pytest

from tandem.agent import AgentLoopRunner, DatasetRow, SingleTurnLoop, ToolAgentLoop
from tandem.config.schema import MultiTurnConfig, RolloutConfig, ValKwargs
from tandem.tools.calculator import CalculatorTool
from tandem.tools.registry import ToolRegistry
from tandem.types import GenerateRequest, TokenOutput


class Format:
    """Stands in for ChatFormat: the runner only needs its methods."""

    stop_token_ids = frozenset([2])

    def prompt_ids(self, messages, tools=None, images=()):
        return [5, 6]

    def decode(self, ids):
        return "answer"

    def strip_stop_text(self, text):
        return text


class CountingClient:
    """Sleeps a little per call and tracks how many calls are in flight at once."""

    def __init__(self, fail_on=None):
        self.in_flight = self.peak = 0
        self.request_ids = []
        self.fail_on = fail_on

    async def generate(self, request):
        request_id, prompt_ids, sampling_params = request.request_id, request.prompt_ids, request.sampling
        self.request_ids.append(request_id)
        self.in_flight += 1
        self.peak = max(self.peak, self.in_flight)
        await asyncio.sleep(0.01)
        self.in_flight -= 1
        if request_id == self.fail_on:
            raise RuntimeError("engine died")
        return TokenOutput([7, 2], [-0.1, -0.2], "completed", {"global_steps": 1})


def rows(count, **fields):
    return [DatasetRow(messages=[{"role": "user", "content": str(i)}], uid=f"p{i}", index=i,
                       **fields) for i in range(count)]


async def test_n_sessions_per_prompt_with_row_override_and_val_n():
    client = CountingClient()
    runner = AgentLoopRunner(client, Format(), RolloutConfig(
        prompt_length=4, response_length=8, n=3, val_kwargs=ValKwargs(n=2)))
    batch = rows(2)
    batch[1].rollout_n = 5
    trajectories = await runner.run(batch)
    assert [(t.uid, t.session_id) for t in trajectories] == (
        [("p0", i) for i in range(3)] + [("p1", i) for i in range(5)])
    assert sorted(client.request_ids) == sorted(f"{t.uid}-{t.session_id}" for t in trajectories)
    validation = await runner.run(rows(2), validate=True)
    assert [(t.uid, t.session_id) for t in validation] == [
        ("p0", 0), ("p0", 1), ("p1", 0), ("p1", 1)]
    assert all(t.metadata["validate"] for t in validation)


async def test_concurrency_is_bounded():
    client = CountingClient()
    runner = AgentLoopRunner(client, Format(), RolloutConfig(
        prompt_length=4, response_length=8, n=4, agent_concurrency=3))
    trajectories = await runner.run(rows(5))
    assert len(trajectories) == 20 and client.peak == 3


async def test_reward_fn_sync_and_async():
    def reward(trajectory, row):
        return float(row.index), {"row": row.index}

    async def async_reward(trajectory, row):
        return 1.5, {}

    for fn, expected in ((reward, [0.0, 1.0]), (async_reward, [1.5, 1.5])):
        runner = AgentLoopRunner(CountingClient(), Format(),
                                 RolloutConfig(prompt_length=4, response_length=8, n=1),
                                 reward_fn=fn)
        trajectories = await runner.run(rows(2))
        assert [t.reward for t in trajectories] == expected
    assert trajectories[0].reward_extra == {}


async def test_loop_choice_follows_multi_turn_enable():
    config = RolloutConfig(multi_turn=MultiTurnConfig(enable=True, tools=["calculator"]))
    runner = AgentLoopRunner(CountingClient(), Format(), config)
    assert isinstance(runner.loop, ToolAgentLoop) and runner.loop.tools.names() == ["calculator"]
    assert isinstance(AgentLoopRunner(CountingClient(), Format(), RolloutConfig()).loop,
                      SingleTurnLoop)


@pytest.mark.parametrize("config, tools, words", [
    (RolloutConfig(multi_turn=MultiTurnConfig(enable=True)), None, "no tools are registered"),
    (RolloutConfig(), ToolRegistry([CalculatorTool()]), "rollout.multi_turn.enable=false"),
    (RolloutConfig(multi_turn=MultiTurnConfig(enable=True, tools=["search"])), None,
     "unknown tool 'search'"),
    (RolloutConfig(agent_concurrency=0), None, "rollout.agent_concurrency=0"),
])
def test_configuration_errors(config, tools, words):
    with pytest.raises(ValueError, match=words):
        AgentLoopRunner(CountingClient(), Format(), config, tools=tools)


async def test_uid_errors():
    runner = AgentLoopRunner(CountingClient(), Format(), RolloutConfig(n=1))
    with pytest.raises(ValueError, match="share a uid"):
        await runner.run(rows(1) + rows(1))
    with pytest.raises(ValueError, match="has no uid"):
        await runner.run([DatasetRow(messages=[{"role": "user", "content": "x"}])])


async def test_a_failing_session_fails_alone():
    client = CountingClient(fail_on="p0-1")
    runner = AgentLoopRunner(client, Format(), RolloutConfig(
        prompt_length=4, response_length=8, n=2, agent_concurrency=1))
    trajectories = await runner.run(rows(10))
    assert len(client.request_ids) == 20  # nothing was cancelled
    assert [(t.uid, t.session_id) for t in trajectories] == (
        [("p0", 0)] + [(f"p{i}", s) for i in range(1, 10) for s in range(2)])
    [failure] = runner.take_failures()
    assert (failure.uid, failure.session_id, str(failure.error)) == ("p0", 1, "engine died")
    assert runner.take_failures() == []


async def test_when_every_session_fails_the_call_raises():
    client = CountingClient(fail_on="p0-0")
    runner = AgentLoopRunner(client, Format(), RolloutConfig(prompt_length=4, response_length=8, n=1))
    with pytest.raises(RuntimeError, match=r"all 1 sessions failed; the first \(p0-0\): "
                                           "RuntimeError: engine died"):
        await runner.run(rows(1))


def test_a_given_registry_must_hold_the_configured_tools():
    config = RolloutConfig(multi_turn=MultiTurnConfig(enable=True, tools=["calculator", "python"]))
    with pytest.raises(ValueError, match=r"lists \['python'\], which the given ToolRegistry lacks"):
        AgentLoopRunner(CountingClient(), Format(), config, tools=ToolRegistry([CalculatorTool()]))


@pytest.mark.parametrize("overrides, words", [
    (["rollout.multi_turn.tools=[search]"], "rollout.multi_turn.tools: unknown tool 'search'"),
    (["rollout.multi_turn.tools=[nowhere.py:Search]"], "rollout.multi_turn.tools: 'nowhere.py:Search': no file"),
    (["rollout.multi_turn.tools=[tandem.tools.calculator:Nothing]"],
     "defines no 'Nothing'"),
    (["rollout.multi_turn.tools=[tandem.tools.calculator:evaluate_expression]"], "not a class"),
])
def test_tool_names_are_checked_before_the_run_starts(overrides, words):
    from tandem.config.load import ConfigError, load_config
    from tandem.preflight import check_names

    config = load_config(overrides=["rollout.multi_turn.enable=true", *overrides])
    with pytest.raises(ConfigError, match=words):
        check_names(config)


class RecordingClient(CountingClient):
    """Also keeps every sampling dict it was sent."""

    def __init__(self):
        super().__init__()
        self.params = {}

    async def generate(self, request):
        request_id, prompt_ids, sampling_params = request.request_id, request.prompt_ids, request.sampling
        self.params[request_id] = dict(sampling_params)
        return await super().generate(GenerateRequest(request_id, prompt_ids, sampling_params))


async def test_seeds_per_session_and_progress_callback():
    client = RecordingClient()
    runner = AgentLoopRunner(client, Format(), RolloutConfig(prompt_length=4, response_length=8, n=2))
    seen = []
    await runner.run(rows(2), seeds=[100, 200], on_trajectory=seen.append)
    assert len(seen) == 4
    assert {rid: p["seed"] for rid, p in client.params.items()} == {
        "p0-0": 100, "p0-1": 1100, "p1-0": 200, "p1-1": 1200}
    unseeded = RecordingClient()
    await AgentLoopRunner(unseeded, Format(), RolloutConfig(prompt_length=4, response_length=8, n=1)).run(rows(1))
    assert "seed" not in unseeded.params["p0-0"]
    with pytest.raises(ValueError, match="one per row"):
        await runner.run(rows(2), seeds=[1])
