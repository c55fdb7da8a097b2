"""A verifiers environment (tests/envs/tandem_sums, made here, no network) as an agent loop: its
harness's calls reach tandem's endpoint through verifiers' interception, every sample is
token-exact (mask 1 exactly on what the engine sampled, its logprobs), the rubric's total is
the environment reward. Skipped without the `verifiers` package (`make verifiers`)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("verifiers.v1")

from test_openai_split import ScriptEngine, assert_token_exact  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

from tandem.agent.chat_format import ChatFormat  # noqa: E402
from tandem.agent.dataset import DatasetRow  # noqa: E402
from tandem.agent.runner import AgentLoopRunner  # noqa: E402
from tandem.agent.verifiers_env import API_KEY_VAR, VerifiersLoop  # noqa: E402
from tandem.config.schema import RewardConfig, RolloutConfig  # noqa: E402
from tandem.models.tiny import build_tiny_model  # noqa: E402
from tandem.rewards.scorer import RewardScorer  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent / "envs"))  # installs tandem_sums


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(build_tiny_model())


def runner(tokenizer, engine, api_key: str = "", **environment) -> AgentLoopRunner:
    config = RolloutConfig(prompt_length=300, response_length=200, n=2)
    config.openai_agent.api_key = api_key
    config.environment.kind, config.environment.id = "verifiers", "tandem-sums"
    for name, value in environment.items():
        setattr(config.environment, name, value)
    scorer = RewardScorer.from_config(RewardConfig(), environment=config.environment)
    return AgentLoopRunner(engine, ChatFormat(tokenizer), config, reward_fn=scorer.score_one)


async def test_episodes_are_recorded_token_exact_and_the_rubric_is_the_reward(tokenizer):
    engine = ScriptEngine(tokenizer, ["Let me think.", "The answer is 317."])
    loop = runner(tokenizer, engine, args={"count": 2})
    assert isinstance(loop.loop, VerifiersLoop) and len(loop.loop.tasks) == 2
    try:
        samples = await loop.run([DatasetRow(messages=[], uid="r0", raw={"task": 0}),
                                  DatasetRow(messages=[], uid="r1", raw={"task": "sum-1"})])
    finally:
        await loop.close()
    assert len(samples) == 4 and len(engine.calls) == 8  # 2 rows x n=2, two turns each
    assert assert_token_exact(engine.calls, samples).count(0) == 2  # each call in one sample
    for sample in samples:
        assert sample.metadata["assistant_turns"] == 2 and sample.metadata["forks"] == 0
        assert sample.metadata["splits"] == 0
        texts = [m["content"] for m in sample.metadata["messages"]]
        assert texts[-1] in ("Let me think.", "The answer is 317.")
        assert "Now say only the final number." in texts  # the harness's second turn
    # task 0 is 100 + 200: the reply "317" is wrong there (0.25), right for task 1 (117 + 231?)
    by_task = {s.metadata["environment_task"]: s for s in samples}
    assert set(by_task) == {0, 1}
    for sample in samples:
        expected = sample.metadata["environment_reward"]
        assert sample.reward == expected and sample.metadata["environment_rewards"]["correct"] == expected


async def test_an_endpoint_with_an_api_key_is_reached_with_it(tokenizer, monkeypatch):
    """rollout.openai_agent.api_key guards the endpoint; verifiers' client reads it from the
    environment variable the loop sets."""
    monkeypatch.delenv(API_KEY_VAR, raising=False)
    engine = ScriptEngine(tokenizer, ["Let me think.", "The answer is 300."])
    loop = runner(tokenizer, engine, api_key="sk-tandem-test", args={"count": 1})
    try:
        samples = await loop.run([DatasetRow(messages=[], uid="r0", raw={"task": 0})])
    finally:
        await loop.close()
    assert len(samples) == 2 and len(engine.calls) == 4  # a refused call would fail the episode
    assert all(s.reward in (0.25, 1.0) for s in samples)


async def test_a_row_without_a_known_task_fails_its_session_with_the_choices(tokenizer):
    loop = runner(tokenizer, ScriptEngine(tokenizer, ["x"]), args={"count": 2})
    try:
        with pytest.raises(Exception, match="task 7 is not a task of 'tandem-sums'"):
            await loop.run([DatasetRow(messages=[], uid="r0", raw={"task": 7})])
    finally:
        await loop.close()


def test_an_unknown_environment_names_the_field():
    config = RolloutConfig()
    config.environment.kind, config.environment.id = "verifiers", "no-such-env-anywhere"
    with pytest.raises(ValueError, match="rollout.environment.id='no-such-env-anywhere'"):
        VerifiersLoop(None, None, config)
