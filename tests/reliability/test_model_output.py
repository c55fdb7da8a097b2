"""Issue 11, "one model output kills the run": whatever the model writes (deep JSON, huge
integers, thousands of calls, a calculator expression that never ends) or a tool or reward
does, the damage stays in that session, and the agent loop never blocks on a tool."""

from __future__ import annotations

import asyncio
import threading

import pytest

from tandem.agent import AgentLoopRunner, DatasetRow, Session, ToolAgentLoop
from tandem.agent.tool_parser import parse_tool_calls
from tandem.config.schema import MultiTurnConfig, RolloutConfig
from tandem.tools import calculator
from tandem.tools.calculator import CalculatorError, CalculatorTool, evaluate_expression
from tandem.tools.registry import ToolRegistry, ToolResult
from tandem.types import TokenOutput

EOS = 2
DEEP = "[" * 1000 + "]" * 1000
HUGE = "7" * 5000


def call(name: str, arguments: str) -> str:
    return '<tool_call>{"name": "%s", "arguments": %s}</tool_call>' % (name, arguments)


class TextClient:
    """Each turn returns one token whose text is the next scripted reply (then "done")."""

    def __init__(self, replies: dict[str, list[str]]) -> None:
        self.replies = replies
        self.texts: dict[int, str] = {}

    async def generate(self, request):
        request_id, prompt_ids, sampling_params = request.request_id, request.prompt_ids, request.sampling
        script = self.replies.setdefault(request_id, [])
        text = script.pop(0) if script else "done"
        token = 100 + len(self.texts)
        self.texts[token] = text
        return TokenOutput([token, EOS], [-0.5, -0.1], "completed", {"global_steps": 0})


class TextFormat:
    """Decodes the client's tokens to their scripted text; a tool turn is two tokens."""

    stop_token_ids = frozenset([EOS])

    def __init__(self, client: TextClient) -> None:
        self.client = client
        self.tool_turns: list[list[dict]] = []

    def prompt_ids(self, messages, tools=None, images=()):
        return [11, 12]

    def tool_turn_ids(self, tool_messages, after_stop_token):
        self.tool_turns.append(list(tool_messages))
        return [31, 32]

    def decode(self, ids):
        return "".join(self.client.texts.get(i, "") for i in ids)

    def strip_stop_text(self, text):
        return text

    def encode_text(self, text):
        return list(range(len(text)))

    def decode_text(self, ids):
        return "x" * len(ids)


class CountingTool:
    name = "count"
    description = "counts its calls"
    parameters = {"type": "object", "properties": {}}

    def __init__(self) -> None:
        self.calls = 0

    async def execute(self, arguments, context):
        self.calls += 1
        return ToolResult(str(self.calls))


class BrokenTool:
    name = "broken"
    description = "raises"
    parameters = {"type": "object", "properties": {}}

    async def execute(self, arguments, context):
        raise RuntimeError("tool host broke")


def rollout_config(**multi_turn) -> RolloutConfig:
    return RolloutConfig(prompt_length=8, response_length=64, n=1, multi_turn=MultiTurnConfig(
        enable=True, max_tool_response_length=10_000, tools=["calculator"], **multi_turn))


def loop_for(replies: list[str], tools, **multi_turn) -> tuple[ToolAgentLoop, TextFormat]:
    client = TextClient({"u-0": list(replies)})
    chat_format = TextFormat(client)
    return ToolAgentLoop(client, chat_format, rollout_config(**multi_turn), ToolRegistry(tools)), chat_format


def session(uid: str = "u") -> Session:
    return Session(DatasetRow(messages=[{"role": "user", "content": "?"}], uid=uid), 0, f"{uid}-0")


@pytest.mark.parametrize("text, words", [
    (f"<tool_call>{DEEP}</tool_call>", "not valid JSON (nested too deeply)"),
    (call("calculator", '{"expression": %s}' % DEEP), "not valid JSON (nested too deeply)"),
    (call("calculator", '"%s"' % DEEP.replace('"', "")), "not a JSON object (nested too deeply)"),
    (call("calculator", '{"expression": %s}' % HUGE), "Exceeds the limit (4300 digits)"),
    (call("calculator", '"{\\"x\\": %s}"' % HUGE), "Exceeds the limit (4300 digits)"),
])
def test_the_parser_turns_every_malformed_payload_into_an_error_call(text, words):
    _, [parsed] = parse_tool_calls(text)
    assert parsed.error is not None and words in parsed.error
    assert parsed.arguments == {}


async def test_the_loop_answers_deep_and_huge_calls_and_goes_on():
    replies = [f"<tool_call>{DEEP}</tool_call>", call("calculator", '{"expression": %s}' % HUGE),
               call("calculator", '{"expression": "2+3"}')]
    loop, chat_format = loop_for(replies, [CalculatorTool()])
    trajectory = await loop.run(session())
    assert trajectory.stop_reason == "completed"
    answers = [turn[0]["content"] for turn in chat_format.tool_turns]
    assert "nested too deeply" in answers[0] and "4300 digits" in answers[1]
    assert answers[2] == "5"
    assert (trajectory.metadata["tool_calls"], trajectory.metadata["tool_errors"]) == (3, 2)


async def test_ten_thousand_calls_in_a_turn_run_only_up_to_the_cap():
    tool = CountingTool()
    loop, chat_format = loop_for([call("count", "{}") * 10_000], [tool, CalculatorTool()],
                                 max_tool_calls_per_turn=8)
    trajectory = await loop.run(session())
    assert tool.calls == 8
    [messages] = chat_format.tool_turns
    assert [m["content"] for m in messages[:8]] == [str(i) for i in range(1, 9)]
    assert messages[8]["content"] == ("Error: 10000 tool calls in one turn; only the first 8 ran "
                                      "(rollout.multi_turn.max_tool_calls_per_turn=8). Make "
                                      "fewer calls per turn.")
    assert len(messages) == 9
    assert (trajectory.metadata["tool_calls"], trajectory.metadata["tool_errors"]) == (10_000, 9_992)


@pytest.mark.parametrize("expression", ["round(1, -10**9)", "round(7, -10**100)",
                                        "round(1.5, 10**9)", "round(2**4000, -1301)"])
def test_calculator_round_refuses_digits_it_cannot_afford(expression):
    with pytest.raises(CalculatorError, match=r"round: ndigits -?\d+ is beyond \+-1300"):
        evaluate_expression(expression)


def test_calculator_round_still_rounds():
    assert evaluate_expression("round(123456, -2)") == 123500
    assert evaluate_expression("round(2.675, 1)") == 2.7
    assert evaluate_expression("round(1, -1300)") == 0


async def test_the_calculator_evaluates_off_the_event_loop(monkeypatch):
    threads = []

    def recording(expression):
        threads.append(threading.current_thread())
        return 4

    monkeypatch.setattr(calculator, "evaluate_expression", recording)
    result = await CalculatorTool().execute({"expression": "2+2"}, {})
    assert result.text == "4" and threads and threads[0] is not threading.current_thread()


class StuckTool:
    """Blocks in a worker thread until released (a tool whose work never ends)."""

    name = "stuck"
    description = "never returns"
    parameters = {"type": "object", "properties": {}}

    def __init__(self) -> None:
        self.release = threading.Event()

    async def execute(self, arguments, context):
        await asyncio.to_thread(self.release.wait, 120)
        return ToolResult("finished")


class SleepyTool:
    name = "sleepy"
    description = "awaits forever"
    parameters = {"type": "object", "properties": {}}

    async def execute(self, arguments, context):
        await asyncio.Event().wait()


async def test_every_call_has_a_deadline_enforced_outside_the_tool():
    stuck = StuckTool()
    loop, chat_format = loop_for([call("stuck", "{}") + call("sleepy", "{}")],
                                 [stuck, SleepyTool(), CalculatorTool()], tool_timeout_seconds=0.2)
    ticks = 0

    async def ticker():
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0.01)

    ticking = asyncio.create_task(ticker())
    try:
        trajectory = await loop.run(session())
    finally:
        ticking.cancel()
        stuck.release.set()
    assert trajectory.stop_reason == "completed"
    [messages] = chat_format.tool_turns
    assert [m["content"] for m in messages] == [
        "Error: the stuck call ran longer than 0.2 s and was stopped",
        "Error: the sleepy call ran longer than 0.2 s and was stopped"]
    assert ticks > 1  # the event loop kept running while both tools were stuck


async def test_a_raising_tool_or_reward_fails_only_its_session():
    client = TextClient({"bad-0": [call("broken", "{}")]})
    rows = [DatasetRow(messages=[{"role": "user", "content": "?"}], uid=uid)
            for uid in ("ok", "bad", "reward", "ok2")]

    def reward_fn(trajectory, row):
        if row.uid == "reward":
            raise ZeroDivisionError("reward blew up")
        return 1.0, {}

    runner = AgentLoopRunner(client, TextFormat(client), rollout_config(),
                             tools=ToolRegistry([BrokenTool(), CalculatorTool()]), reward_fn=reward_fn)
    trajectories = await runner.run(rows)
    assert [t.uid for t in trajectories] == ["ok", "ok2"]
    assert all(t.reward == 1.0 for t in trajectories)
    failures = runner.take_failures()
    assert sorted((f.uid, type(f.error).__name__, str(f.error)) for f in failures) == [
        ("bad", "RuntimeError", "tool host broke"), ("reward", "ZeroDivisionError", "reward blew up")]


async def test_a_batch_built_from_survivors_is_well_formed():
    from tandem.batch.jagged import trajectories_to_batch

    client = TextClient({"bad-0": [call("broken", "{}")]})
    rows = [DatasetRow(messages=[{"role": "user", "content": "?"}], uid=uid) for uid in ("a", "bad")]
    runner = AgentLoopRunner(client, TextFormat(client), rollout_config(),
                             tools=ToolRegistry([BrokenTool(), CalculatorTool()]))
    batch = trajectories_to_batch(await runner.run(rows))
    assert batch["responses"].shape[0] == 1
    assert len(runner.take_failures()) == 1
