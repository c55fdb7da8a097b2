"""Hypothesis: random multi-turn tool conversations keep DESIGN §3 invariants 1 and 5.

Invariant 1: len(responses) == len(response_mask) == len(rollout_log_probs); mask 0 exactly
where the policy did not sample; logprob 0.0 there. Invariant 5: those tokens contribute
exactly zero to the policy loss. The expected stream is replayed from what the client sampled
and what the chat format rendered, so every position is checked, not just counts.
"""

from __future__ import annotations

import asyncio

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tandem.agent import DatasetRow, Session, ToolAgentLoop
from tandem.algorithms.policy_loss import ppo_clip_loss
from tandem.config.schema import MultiTurnConfig, RolloutConfig
from tandem.tools.registry import ToolRegistry, ToolResult
from tandem.types import TokenOutput

EOS, GOOD_CALL, BAD_CALL = 199, 150, 151
PROMPT = [1, 2, 3, 4]
TEXTS = {GOOD_CALL: '<tool_call>{"name": "echo", "arguments": {"text": "abcdefghij"}}</tool_call>',
         BAD_CALL: "<tool_call>{oops</tool_call>", EOS: "<eos>"}


class Echo:
    name, description = "echo", "echo"
    parameters = {"type": "object", "properties": {"text": {"type": "string"}}}

    async def execute(self, arguments, context):
        return ToolResult(arguments["text"])


class LoggingFormat:
    stop_token_ids = frozenset([EOS])

    def __init__(self):
        self.deltas: list[list[int]] = []

    def prompt_ids(self, messages, tools=None, images=()):
        return list(PROMPT)

    def tool_turn_ids(self, tool_messages, after_stop_token):
        delta = [] if after_stop_token else [EOS]
        for message in tool_messages:
            delta += [398] + [300 + ord(c) % 90 for c in message["content"]]
        delta.append(399)
        self.deltas.append(delta)
        return delta

    def decode(self, ids):
        return "".join(TEXTS.get(i, "x") for i in ids)

    def strip_stop_text(self, text):
        return text.removesuffix("<eos>")

    def encode_text(self, text):
        return [ord(c) for c in text]

    def decode_text(self, ids):
        return "".join(map(chr, ids))


class RandomTurnClient:
    """Plays scripted turns (plain tokens, tool-call tokens, maybe eos), cut to max_tokens."""

    def __init__(self, turns):
        self.turns = list(turns)
        self.outputs: list[TokenOutput] = []
        self.calls: list[tuple[list[int], dict]] = []

    async def generate(self, request):
        request_id, prompt_ids, sampling_params = request.request_id, request.prompt_ids, request.sampling
        self.calls.append((list(prompt_ids), dict(sampling_params)))
        turn = self.turns.pop(0) if self.turns else {"plain": 2, "good": 0, "bad": 0,
                                                      "eos": True, "stop": "completed"}
        tokens = ([100 + (7 * i) % 40 for i in range(turn["plain"])] + [GOOD_CALL] * turn["good"]
                  + [BAD_CALL] * turn["bad"] + ([EOS] if turn["eos"] else []))
        stop = turn["stop"]
        if len(tokens) > sampling_params["max_tokens"]:
            tokens, stop = tokens[:sampling_params["max_tokens"]], "length"
        log_probs = [-0.01 - (t % 13) / 10 for t in tokens]  # never 0.0
        output = TokenOutput(tokens, log_probs, stop, {"global_steps": len(self.outputs)})
        self.outputs.append(output)
        return output


turns = st.lists(st.fixed_dictionaries({
    "plain": st.integers(0, 5), "good": st.integers(0, 2), "bad": st.integers(0, 1),
    "eos": st.booleans(), "stop": st.sampled_from(["completed"] * 6 + ["length", "aborted"])}),
    min_size=1, max_size=6)
limits = st.fixed_dictionaries({
    "response_length": st.integers(1, 60), "max_assistant_turns": st.integers(1, 5),
    "max_user_turns": st.integers(1, 5), "max_tool_response_length": st.integers(1, 12),
    "tool_response_truncate_side": st.sampled_from(["left", "right", "middle"])})


def run_session(script, limit):
    config = RolloutConfig(prompt_length=len(PROMPT), response_length=limit["response_length"],
                           multi_turn=MultiTurnConfig(
                               enable=True, max_assistant_turns=limit["max_assistant_turns"],
                               max_user_turns=limit["max_user_turns"],
                               max_tool_response_length=limit["max_tool_response_length"],
                               tool_response_truncate_side=limit["tool_response_truncate_side"]))
    client, chat_format = RandomTurnClient(script), LoggingFormat()
    loop = ToolAgentLoop(client, chat_format, config, ToolRegistry([Echo()]))
    row = DatasetRow(messages=[{"role": "user", "content": "q"}], uid="u")
    trajectory = asyncio.run(loop.run(Session(row, 0, "u-0")))
    return trajectory, client, chat_format, config


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(script=turns, limit=limits)
def test_random_conversations_keep_invariant_1(script, limit):
    trajectory, client, chat_format, config = run_session(script, limit)
    responses = trajectory.responses.tolist()
    mask = trajectory.response_mask.tolist()
    log_probs = trajectory.rollout_log_probs.tolist()
    assert len(responses) == len(mask) == len(log_probs) <= config.response_length

    # Replay: model output i, then tool delta i, ...; the last delta may be cut by the budget.
    expected, expected_mask, expected_log_probs = [], [], []
    for i, output in enumerate(client.outputs):
        expected += output.token_ids
        expected_mask += [1] * len(output.token_ids)
        expected_log_probs += output.log_probs
        if i < len(chat_format.deltas):
            expected += chat_format.deltas[i]
            expected_mask += [0] * len(chat_format.deltas[i])
            expected_log_probs += [0.0] * len(chat_format.deltas[i])
    cut = config.response_length
    assert responses == expected[:cut]
    assert mask == expected_mask[:cut]
    assert log_probs == torch.tensor(expected_log_probs[:cut], dtype=torch.float32).tolist()
    assert all((lp == 0.0) == (m == 0) for lp, m in zip(log_probs, mask))

    # Every call continues the exact stream and asks for exactly the remaining budget.
    stream = trajectory.input_ids.tolist()
    for prompt_ids, params in client.calls:
        assert prompt_ids == stream[:len(prompt_ids)]
        assert params["max_tokens"] == config.response_length - (len(prompt_ids) - len(PROMPT))
    assert len(client.outputs) <= config.multi_turn.max_assistant_turns
    assert len(chat_format.deltas) <= config.multi_turn.max_user_turns
    assert trajectory.num_turns == 1 + len(client.outputs) + len(chat_format.deltas)
    assert (trajectory.min_global_steps, trajectory.max_global_steps) == (0, len(client.outputs) - 1)


@settings(max_examples=60, deadline=None)
@given(script=turns, limit=limits, seed=st.integers(0, 2**16))
def test_tool_tokens_contribute_zero_to_the_policy_loss(script, limit, seed):
    trajectory, *_ = run_session(script, limit)
    mask = trajectory.response_mask[None]
    length = mask.shape[1]
    generator = torch.Generator().manual_seed(seed)
    rollout = trajectory.rollout_log_probs[None]
    advantages = torch.randn(1, length, generator=generator)
    log_probs = (rollout + 0.1 * torch.randn(1, length, generator=generator)).requires_grad_(True)
    loss = ppo_clip_loss(log_probs, rollout, advantages, mask).loss.sum()
    loss.backward()
    assert torch.all(log_probs.grad[mask == 0] == 0)

    # Changing anything at the tool positions changes nothing.
    noise = torch.where(mask == 0, 5.0, 0.0)
    perturbed = ppo_clip_loss(log_probs.detach() + noise, rollout - noise, advantages + noise,
                              mask).loss
    assert torch.equal(perturbed.sum(), loss.detach())
