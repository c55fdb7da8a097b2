"""Single-turn and tool-calling loops against a scripted client and a scripted chat format.

Includes the seed's worked example (§7.2) and the behaviour at every stop condition.
"""

from __future__ import annotations

import pytest
import torch

from tandem.agent import DatasetRow, Session, SingleTurnLoop, ToolAgentLoop
from tandem.config.schema import MultiTurnConfig, RolloutConfig
from tandem.tools.calculator import CalculatorTool
from tandem.tools.registry import ToolRegistry, ToolResult
from tandem.types import TokenOutput

EOS = 22


class ScriptedClient:
    """Returns queued TokenOutputs in order and records every call."""

    def __init__(self, outputs: list[TokenOutput]) -> None:
        self.outputs = list(outputs)
        self.calls: list[tuple[str, list[int], dict]] = []

    async def generate(self, request):
        request_id, prompt_ids, sampling_params = request.request_id, request.prompt_ids, request.sampling
        self.calls.append((request_id, list(prompt_ids), dict(sampling_params)))
        return self.outputs.pop(0)


class ScriptedFormat:
    """A chat format with fixed ids: the prompt is [11, 12, 13], every tool turn is
    [31, 32] (or [EOS, 31, 32] when the model's tokens did not end with EOS)."""

    stop_token_ids = frozenset([EOS])

    def __init__(self, texts: dict[int, str], tool_ids=(31, 32)) -> None:
        self.texts = texts
        self.tool_ids = list(tool_ids)
        self.tool_turns: list[list[dict]] = []

    def prompt_ids(self, messages, tools=None, images=()):
        return [11, 12, 13]

    def tool_turn_ids(self, tool_messages, after_stop_token):
        self.tool_turns.append(list(tool_messages))
        return ([] if after_stop_token else [EOS]) + self.tool_ids

    def decode(self, ids):
        return "".join(self.texts.get(i, f"<{i}>") for i in ids)

    def strip_stop_text(self, text):
        return text.removesuffix("<eos>")

    def encode_text(self, text):
        return [ord(c) for c in text]

    def decode_text(self, ids):
        return "".join(chr(i) for i in ids)


def out(tokens, logprobs, stop="completed", version=0, **extra):
    return TokenOutput(tokens, logprobs, stop, {"global_steps": version, **extra})


def call_text(expression: str) -> str:
    return '<tool_call>{"name": "calculator", "arguments": {"expression": "%s"}}</tool_call>' % expression


def row(**fields) -> DatasetRow:
    return DatasetRow(messages=[{"role": "user", "content": "2+3?"}], uid="u1",
                      data_source="arithmetic", ground_truth="5", **fields)


def config(**multi_turn) -> RolloutConfig:
    return RolloutConfig(prompt_length=8, response_length=16, n=1,
                         multi_turn=MultiTurnConfig(enable=True, **multi_turn))


def tool_loop(client, chat_format, rollout_config=None, tools=None):
    tools = tools or ToolRegistry([CalculatorTool()])
    return ToolAgentLoop(client, chat_format, rollout_config or config(), tools)


async def test_seed_worked_example():
    """Seed §7.2: prompt [11,12,13], response [21,22,31,32,23], 31 and 32 from a tool."""
    a, b, c = -0.5, -0.25, -0.125
    client = ScriptedClient([out([21, 22], [a, b]), out([23], [c])])
    chat_format = ScriptedFormat({21: call_text("2+3"), 22: "<eos>", 23: "The answer is 5."})
    trajectory = await tool_loop(client, chat_format).run(Session(row(), 0, "u1-0"))

    assert trajectory.prompts.tolist() == [11, 12, 13] and trajectory.prompts.shape == (3,)
    assert trajectory.responses.tolist() == [21, 22, 31, 32, 23]
    assert trajectory.input_ids.tolist() == [11, 12, 13, 21, 22, 31, 32, 23]
    assert trajectory.input_ids.shape == (8,) and trajectory.position_ids.tolist() == list(range(8))
    assert trajectory.response_mask.tolist() == [1, 1, 0, 0, 1]
    assert trajectory.loss_mask.tolist() == [1, 1, 0, 0, 1]
    assert trajectory.rollout_log_probs.tolist() == [a, b, 0.0, 0.0, c]
    assert trajectory.rollout_log_probs.dtype == torch.float32
    assert trajectory.stop_reason == "completed" and trajectory.num_turns == 4
    # the second call continues the exact stream: no re-tokenization
    assert client.calls[1][1] == [11, 12, 13, 21, 22, 31, 32]
    assert chat_format.tool_turns == [[{"role": "tool", "content": "5"}]]
    assert trajectory.metadata["response_text"] == "The answer is 5."
    assert trajectory.metadata["tool_calls"] == 1 and trajectory.metadata["tool_errors"] == 0


async def test_request_id_is_sticky_and_budget_shrinks():
    client = ScriptedClient([out([21, 22], [-1.0, -1.0]), out([23], [-1.0])])
    chat_format = ScriptedFormat({21: call_text("1"), 22: "<eos>"})
    await tool_loop(client, chat_format).run(Session(row(), 3, "u1-3"))
    assert [call[0] for call in client.calls] == ["u1-3", "u1-3"]
    assert [call[2]["max_tokens"] for call in client.calls] == [16, 12]  # 16 - 2 model - 2 tool


async def test_missing_eos_gets_the_boundary_eos_with_mask_zero():
    client = ScriptedClient([out([21], [-1.0]), out([23], [-1.0])])
    chat_format = ScriptedFormat({21: call_text("1")})
    trajectory = await tool_loop(client, chat_format).run(Session(row(), 0, "u1-0"))
    assert trajectory.responses.tolist() == [21, EOS, 31, 32, 23]
    assert trajectory.response_mask.tolist() == [1, 0, 0, 0, 1]


async def test_length_stop_appends_nothing_after_the_cut_turn():
    client = ScriptedClient([out([21] * 4, [-1.0] * 4, stop="length")])
    chat_format = ScriptedFormat({21: call_text("1")})
    trajectory = await tool_loop(client, chat_format).run(Session(row(), 0, "u1-0"))
    assert trajectory.responses.tolist() == [21] * 4 and trajectory.stop_reason == "length"
    assert len(client.calls) == 1


async def test_aborted_result_ends_the_session_with_its_partial_tokens():
    client = ScriptedClient([out([21, 22], [-1.0, -2.0]), out([24, 25], [-3.0, -4.0], "aborted")])
    chat_format = ScriptedFormat({21: call_text("1"), 22: "<eos>"})
    trajectory = await tool_loop(client, chat_format).run(Session(row(), 0, "u1-0"))
    assert trajectory.responses.tolist() == [21, 22, 31, 32, 24, 25]
    assert trajectory.response_mask.tolist() == [1, 1, 0, 0, 1, 1]
    assert trajectory.stop_reason == "aborted"


async def test_tool_turn_is_cut_to_the_response_budget():
    rollout_config = config()
    rollout_config.response_length = 3
    client = ScriptedClient([out([21, 22], [-1.0, -1.0])])
    chat_format = ScriptedFormat({21: call_text("1"), 22: "<eos>"})
    trajectory = await tool_loop(client, chat_format, rollout_config).run(Session(row(), 0, "x"))
    assert trajectory.responses.tolist() == [21, 22, 31]
    assert trajectory.response_mask.tolist() == [1, 1, 0]
    assert trajectory.stop_reason == "length" and len(client.calls) == 1


@pytest.mark.parametrize("limits, turns, reason", [
    ({"max_assistant_turns": 2}, 2, "max_assistant_turns"),
    ({"max_user_turns": 1}, 2, "max_user_turns"),
])
async def test_turn_limits(limits, turns, reason):
    client = ScriptedClient([out([21, 22], [-1.0, -1.0]) for _ in range(5)])
    chat_format = ScriptedFormat({21: call_text("1"), 22: "<eos>"})
    trajectory = await tool_loop(client, chat_format, config(**limits)).run(Session(row(), 0, "x"))
    assert len(client.calls) == turns and trajectory.stop_reason == reason
    # the last model turn is kept but no tool turn follows it
    assert trajectory.responses.tolist()[-2:] == [21, 22]


@pytest.mark.parametrize("text, expected", [
    ("<tool_call>{not json}</tool_call>", "Error: the tool call is not valid JSON"),
    ('<tool_call>{"name": "search", "arguments": {}}</tool_call>', "Error: unknown tool 'search'"),
    ('<tool_call>{"name": "calculator", "arguments": {"expr": "1"}}</tool_call>',
     "Error: invalid arguments for calculator: missing required argument(s) ['expression']"),
    (call_text("1/0"), "Error: division by zero"),
    ("<tool_call>{\"name\": \"calculator\"", "Error: the tool call is not closed"),
])
async def test_bad_tool_calls_become_error_messages(text, expected):
    client = ScriptedClient([out([21, 22], [-1.0, -1.0]), out([23], [-1.0])])
    chat_format = ScriptedFormat({21: text, 22: "<eos>"})
    trajectory = await tool_loop(client, chat_format).run(Session(row(), 0, "x"))
    assert chat_format.tool_turns[0][0]["content"].startswith(expected)
    assert trajectory.metadata["tool_errors"] == 1 and trajectory.stop_reason == "completed"


class EchoTool:
    name = "echo"
    description = "echo text"
    parameters = {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}

    def __init__(self):
        self.contexts = []

    async def execute(self, arguments, context):
        self.contexts.append(context)
        return ToolResult(arguments["text"])


@pytest.mark.parametrize("side, expected", [
    ("left", "...(truncated)...6789"),
    ("right", "0123...(truncated)..."),
    ("middle", "01...(truncated)...89"),
])
async def test_tool_output_truncation(side, expected):
    echo = EchoTool()
    text = '<tool_call>{"name": "echo", "arguments": {"text": "0123456789"}}</tool_call>'
    client = ScriptedClient([out([21, 22], [-1.0, -1.0]), out([23], [-1.0])])
    chat_format = ScriptedFormat({21: text + text, 22: "<eos>"})
    rollout_config = config(max_tool_response_length=4, tool_response_truncate_side=side)
    loop = tool_loop(client, chat_format, rollout_config, ToolRegistry([echo]))
    await loop.run(Session(row(tools_kwargs={"echo": {"secret": 1}}), 0, "x"))
    assert [m["content"] for m in chat_format.tool_turns[0]] == [expected, expected]
    assert echo.contexts == [{"secret": 1}, {"secret": 1}]


async def test_weight_versions_span_all_turns():
    client = ScriptedClient([out([21, 22], [-1.0, -1.0], version=3),
                             out([23], [-1.0], version=5, min_global_steps=4, max_global_steps=5)])
    chat_format = ScriptedFormat({21: call_text("1"), 22: "<eos>"})
    trajectory = await tool_loop(client, chat_format).run(Session(row(), 0, "x"))
    assert (trajectory.min_global_steps, trajectory.max_global_steps) == (3, 5)
    # per token: each call's version on its tokens, -1 on the tool turn between them
    versions, mask = trajectory.response_versions.tolist(), trajectory.response_mask.tolist()
    assert versions[:2] == [3, 3] and versions[-1] == 5 and 0 in mask
    assert all((v == -1) == (m == 0) for v, m in zip(versions, mask))


async def test_contract_violations_are_errors():
    chat_format = ScriptedFormat({})
    too_many = ScriptedClient([out([1] * 17, [-1.0] * 17)])
    with pytest.raises(ValueError, match="17 tokens for max_tokens=16"):
        await tool_loop(too_many, chat_format).run(Session(row(), 0, "x"))
    no_logprobs = ScriptedClient([out([1], None)])
    with pytest.raises(ValueError, match="no log_probs"):
        await tool_loop(no_logprobs, chat_format).run(Session(row(), 0, "x"))
    no_version = ScriptedClient([TokenOutput([1], [-1.0], "completed", {})])
    with pytest.raises(ValueError, match="global_steps"):
        await tool_loop(no_version, chat_format).run(Session(row(), 0, "x"))


async def test_prompt_longer_than_prompt_length_is_an_error():
    rollout_config = config()
    rollout_config.prompt_length = 2
    with pytest.raises(ValueError, match="rollout.prompt_length=2"):
        await tool_loop(ScriptedClient([]), ScriptedFormat({}), rollout_config).run(
            Session(row(), 0, "x"))


async def test_single_turn_loop():
    client = ScriptedClient([out([21, 23, EOS], [-0.5, -0.25, -0.125], version=2)])
    chat_format = ScriptedFormat({21: "The answer", 23: " is 5.", EOS: "<eos>"})
    rollout_config = RolloutConfig(prompt_length=8, response_length=16)
    trajectory = await SingleTurnLoop(client, chat_format, rollout_config).run(
        Session(row(do_sample=False), 1, "u1-1"))
    assert trajectory.responses.tolist() == [21, 23, EOS]
    assert trajectory.response_mask.tolist() == [1, 1, 1]
    assert trajectory.rollout_log_probs.tolist() == [-0.5, -0.25, -0.125]
    assert trajectory.metadata["response_text"] == "The answer is 5."
    assert (trajectory.uid, trajectory.session_id, trajectory.num_turns) == ("u1", 1, 2)
    assert client.calls[0][2] == {"temperature": 0.0, "top_p": 1.0, "top_k": -1,
                                  "repetition_penalty": 1.0, "logprobs": True, "max_tokens": 16}


async def test_logprobs_disabled_gives_zero_logprobs():
    client = ScriptedClient([out([21], None)])
    rollout_config = RolloutConfig(prompt_length=8, response_length=16, calculate_log_probs=False)
    trajectory = await SingleTurnLoop(client, ScriptedFormat({}), rollout_config).run(
        Session(row(), 0, "x"))
    assert client.calls[0][2]["logprobs"] is False
    assert trajectory.rollout_log_probs.tolist() == [0.0]

