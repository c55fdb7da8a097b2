"""Token-exact black-box sessions whose next prompt does not extend their recorded tokens: a chat
template that strips earlier `<think>` blocks (Qwen3's rule, and DeepSeek-R1's that strips them
from every assistant turn), and a harness that strips them itself. The session splits into
step-wise samples; a comparator checks every engine call against the samples: the prompt the
engine saw is a sample's prefix, what it sampled follows it exactly (one token per character, a
tokenization the tokenizer never produces, so any re-tokenization would show), mask 1 on it, its
logprobs equal the engine's."""

from __future__ import annotations

import copy

import openai
import pytest
from transformers import AutoTokenizer

from tandem.agent.chat_format import ChatFormat
from tandem.agent.dataset import DatasetRow
from tandem.agent.openai_agent import OpenAIAgentLoop
from tandem.agent.openai_endpoint import EndpointServer, create_app
from tandem.agent.recorder import ChatRecorder
from tandem.agent.runner import AgentLoopRunner
from tandem.batch.trajectory import share_split_rewards
from tandem.config.schema import RolloutConfig
from tandem.demo.tasks import calculator_schemas
from tandem.models.tiny import build_tiny_model
from tandem.trainer.step_metrics import trajectory_metrics
from tandem.types import TokenOutput

QUESTION = [{"role": "user", "content": "What is 2 + 3?"}]
ASSISTANT = "{%- elif message.role == 'assistant' %}<|im_start|>assistant\n{{ message.content or '' }}"
LAST_USER = ("{%- set ns = namespace(last_user=-1) %}{%- for m in messages %}{%- if m.role == 'user' "
             "%}{%- set ns.last_user = loop.index0 %}{%- endif %}{%- endfor %}")


def strip_think(before_last_user_only: bool) -> str:
    """The assistant line of a template that drops `...</think>` from assistant turns: those
    before the last user message (Qwen3), or all of them (DeepSeek-R1)."""
    when = "loop.index0 < ns.last_user and " if before_last_user_only else ""
    return ("{%- elif message.role == 'assistant' %}{%- set content = message.content or '' %}"
            f"{{%- if {when}'</think>' in content %}}{{%- set content = "
            "content.split('</think>')[-1].lstrip() %}{%- endif %}<|im_start|>assistant\n{{ content }}")


@pytest.fixture(scope="module")
def plain_tokenizer():
    return AutoTokenizer.from_pretrained(build_tiny_model())


def with_template(tokenizer, assistant_line: str):
    tokenizer = copy.deepcopy(tokenizer)
    assert ASSISTANT in tokenizer.chat_template
    tokenizer.chat_template = LAST_USER + tokenizer.chat_template.replace(ASSISTANT, assistant_line)
    return tokenizer


class ScriptEngine:
    """Samples the next scripted text, one token per character (then EOS), with logprobs that
    differ per call and per token; records every call."""

    def __init__(self, tokenizer, texts: list[str]) -> None:
        self.tokenizer = tokenizer
        self.texts = list(texts)
        self.calls: list[tuple[list[int], TokenOutput]] = []

    async def generate(self, request) -> TokenOutput:
        text = self.texts[len(self.calls) % len(self.texts)]
        tokens = [t for char in text for t in self.tokenizer.encode(char, add_special_tokens=False)]
        tokens = tokens[:request.sampling["max_tokens"] - 1] + [self.tokenizer.eos_token_id]
        base = len(self.calls) + 1
        output = TokenOutput(tokens, [-base - i / 1000 for i in range(len(tokens))], "completed",
                             {"global_steps": 2})
        self.calls.append((list(request.prompt_ids), output))
        return output


CALL = '<think>add them</think><tool_call>{"name": "calculator", "arguments": {"expression": "2 + 3"}}</tool_call>'
ANSWER = "<think>the tool said 5</think>The answer is 5."
FOLLOW_UP = "<think>double it</think>Ten."


async def chat(client: openai.AsyncOpenAI, messages: list[dict], rewrite=None) -> list[dict]:
    """One call; the reply appended (with `rewrite` applied to its content, as a harness may)."""
    response = await client.chat.completions.create(model="tiny", messages=messages,
                                                     tools=calculator_schemas())
    message = response.choices[0].message.model_dump(exclude_none=True)
    if rewrite is not None and message.get("content"):
        message["content"] = rewrite(message["content"])
    return [*messages, message]


async def session(client: openai.AsyncOpenAI, rewrite=None) -> list[dict]:
    """Tool call -> tool result -> answer -> a new user question -> answer."""
    messages = await chat(client, QUESTION, rewrite)
    call = messages[-1]["tool_calls"][0]
    messages.append({"role": "tool", "tool_call_id": call["id"], "content": "5"})
    messages = await chat(client, messages, rewrite)
    messages.append({"role": "user", "content": "And twice that?"})
    return await chat(client, messages, rewrite)


async def three_turn_agent(client: openai.AsyncOpenAI, row) -> None:
    await session(client)


def assert_token_exact(calls: list[tuple[list[int], TokenOutput]], samples) -> list[int]:
    """Each engine call lies in exactly one sample: its prompt a prefix of the sample's tokens,
    its output right after it with mask 1 and the engine's logprobs (unique to each call, so two
    sessions given the same prompt and reply stay apart); every mask-1 token of every sample
    comes from a call. Returns the sample index of each call."""
    owners = []
    covered = [set() for _ in samples]
    for prompt, output in calls:
        found = []
        for index, sample in enumerate(samples):
            stream = sample.input_ids.tolist()
            end = len(prompt) + len(output.token_ids)
            start = len(prompt) - len(sample.prompts)
            log_probs = sample.rollout_log_probs[max(start, 0):start + len(output.token_ids)]
            if (stream[:len(prompt)] == prompt and stream[len(prompt):end] == output.token_ids
                    and log_probs.tolist() == pytest.approx(output.log_probs)):
                found.append(index)
        assert len(found) == 1, found
        sample = samples[found[0]]
        start = len(prompt) - len(sample.prompts)
        span = range(start, start + len(output.token_ids))
        assert start >= 0, "a call's prompt is never shorter than its sample's prompt"
        assert [sample.response_mask[i].item() for i in span] == [1] * len(span)
        assert [sample.rollout_log_probs[i].item() for i in span] == pytest.approx(output.log_probs)
        covered[found[0]].update(span)
        owners.append(found[0])
    for sample, spans in zip(samples, covered):
        policy = {i for i, m in enumerate(sample.response_mask.tolist()) if m == 1}
        assert policy == spans, "mask 1 exactly on what the engine sampled"
        context = [i for i, m in enumerate(sample.response_mask.tolist()) if m == 0]
        assert all(sample.rollout_log_probs[i].item() == 0.0 for i in context)
    return owners


class Endpoint:
    def __init__(self, tokenizer, texts: list[str]) -> None:
        self.engine = ScriptEngine(tokenizer, texts)
        self.format = ChatFormat(tokenizer)
        self.recorder = ChatRecorder(self.engine, self.format,
                                     RolloutConfig(prompt_length=400, response_length=400))
        self.server = EndpointServer(create_app(self.recorder, "tiny"))

    async def __aenter__(self):
        url = await self.server.start()
        self.client = openai.AsyncOpenAI(base_url=url, api_key="x", max_retries=0,
                                         default_headers={"X-Session-Id": "s"})
        return self

    async def __aexit__(self, *exc):
        await self.client.close()
        await self.server.stop()


async def test_a_template_that_strips_earlier_think_splits_the_session_at_the_new_user_turn(
        plain_tokenizer):
    tokenizer = with_template(plain_tokenizer, strip_think(before_last_user_only=True))
    async with Endpoint(tokenizer, [CALL, ANSWER, FOLLOW_UP]) as endpoint:
        messages = await session(endpoint.client)
        calls = endpoint.engine.calls
        samples = endpoint.recorder.close("s")
    assert endpoint.recorder.splits == 1 and endpoint.recorder.forks == 0
    assert len(calls) == 3 and len(samples) == 2
    # the tool turn kept the reasoning (Qwen3's rule): one sample, the tool result mask 0
    assert assert_token_exact(calls, samples) == [0, 0, 1]
    first, second = samples
    # the new user turn: the engine got the template's render, reasoning of turn 1 and 2 gone
    third_prompt = calls[2][0]
    assert third_prompt == ChatFormat(tokenizer).prompt_ids(
        [{"role": m["role"], "content": m.get("content") or "",
          **({"tool_calls": [{"type": "function", "function": {
              "name": c["function"]["name"], "arguments": {"expression": "2 + 3"}}}
              for c in m["tool_calls"]]} if m.get("tool_calls") else {})}
         for m in messages[:-1]], calculator_schemas())
    assert "add them" not in tokenizer.decode(third_prompt)
    assert "the tool said 5" not in tokenizer.decode(third_prompt)
    assert second.prompts.tolist() == third_prompt
    assert first.input_ids.tolist() != third_prompt[:len(first.input_ids)]
    assert first.metadata["continued_by"] == second.metadata["sample_id"]
    assert second.metadata["continued_by"] is None
    assert first.metadata["splits"] == second.metadata["splits"] == 1


async def test_a_template_that_strips_every_think_splits_at_each_turn(plain_tokenizer):
    """DeepSeek-R1's template writes no assistant turn's reasoning, even the last one's: the
    recorded reply (with its reasoning) is never what the template renders, so every later call
    splits instead of appending to tokens the template would not show."""
    tokenizer = with_template(plain_tokenizer, strip_think(before_last_user_only=False))
    async with Endpoint(tokenizer, [CALL, ANSWER, FOLLOW_UP]) as endpoint:
        await session(endpoint.client)
        calls = endpoint.engine.calls
        samples = endpoint.recorder.close("s")
    assert endpoint.recorder.splits == 2 and len(samples) == 3
    assert assert_token_exact(calls, samples) == [0, 1, 2]
    for sample in samples:
        assert sample.response_mask.tolist() == [1] * len(sample.responses)


async def test_a_harness_that_strips_think_splits_and_never_counts_a_fork(plain_tokenizer):
    async with Endpoint(plain_tokenizer, [CALL, ANSWER, FOLLOW_UP]) as endpoint:
        await session(endpoint.client, rewrite=lambda text: text.split("</think>")[-1])
        calls = endpoint.engine.calls
        samples = endpoint.recorder.close("s")
    assert endpoint.recorder.splits == 2 and endpoint.recorder.forks == 0
    assert assert_token_exact(calls, samples) == [0, 1, 2]
    assert [s.metadata["continued_by"] for s in samples] == [
        samples[1].metadata["sample_id"], samples[2].metadata["sample_id"], None]


async def test_a_stable_template_never_splits(plain_tokenizer):
    async with Endpoint(plain_tokenizer, [CALL, ANSWER, FOLLOW_UP]) as endpoint:
        await session(endpoint.client)
        calls = endpoint.engine.calls
        [sample] = endpoint.recorder.close("s")
    assert endpoint.recorder.splits == 0
    assert assert_token_exact(calls, [sample]) == [0, 0, 0]


async def test_split_samples_share_the_sessions_reward_and_show_in_the_metrics(plain_tokenizer):
    tokenizer = with_template(plain_tokenizer, strip_think(before_last_user_only=True))
    config = RolloutConfig(prompt_length=400, response_length=400, n=1)
    config.openai_agent.enable, config.openai_agent.served_model_name = True, "tiny"
    config.openai_agent.agent = "test_openai_split:three_turn_agent"
    scored = []

    def reward_fn(trajectory, row):
        scored.append(trajectory.metadata["response_text"])
        return (1.0 if "Ten" in trajectory.metadata["response_text"] else 0.0), {"acc": 1.0}

    runner = AgentLoopRunner(ScriptEngine(tokenizer, [CALL, ANSWER, FOLLOW_UP]),
                             ChatFormat(tokenizer), config, reward_fn=reward_fn)
    assert isinstance(runner.loop, OpenAIAgentLoop)
    try:
        row = DatasetRow(index=0, messages=QUESTION, uid="row0")
        samples = await runner.run([row])
    finally:
        await runner.close()
    assert len(samples) == 2
    assert scored == ["<think>double it</think>Ten."]  # only the session's last sample is scored
    assert [s.reward for s in samples] == [1.0, 1.0]
    assert [s.reward_extra for s in samples] == [{"acc": 1.0}, {"acc": 1.0}]
    metrics = trajectory_metrics(samples, "reward")
    assert metrics["reward/split"] == 1.0 and metrics["reward/split_samples"] == 1.0


def test_share_split_rewards_follows_chains_and_survives_a_missing_link():
    import torch

    from tandem.batch.trajectory import Trajectory

    def sample(sample_id, continued_by, reward=None):
        one = torch.tensor([1])
        return Trajectory(one, one, one, torch.tensor([0.0]), 0, 0, reward=reward,
                          metadata={"sample_id": sample_id, "continued_by": continued_by})

    chain = [sample("s/0", "s/1"), sample("s/1", "s/2"), sample("s/2", None, reward=0.5),
             sample("t/0", "t/9", reward=None)]
    share_split_rewards(chain)
    assert [t.reward for t in chain] == [0.5, 0.5, 0.5, None]
