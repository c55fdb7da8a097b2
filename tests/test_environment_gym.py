"""Gym-style (OpenEnv-shaped) environments driven by the tool-calling loop: actions are tool calls,
observations tool results (mask 0), `done` ends the session, the step rewards are the
environment's reward, weighted into the scorer's sum."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import BaseModel
from transformers import AutoTokenizer

from tandem.agent.chat_format import ChatFormat
from tandem.agent.dataset import DatasetRow
from tandem.agent.gym_env import GymEnvironmentLoop, observation_text, step_outcome
from tandem.agent.runner import AgentLoopRunner
from tandem.config.load import ConfigError, load_config
from tandem.config.schema import RewardConfig, RolloutConfig
from tandem.models.tiny import build_tiny_model
from tandem.rewards.scorer import RewardScorer
from tandem.types import TokenOutput

ENVS = Path(__file__).parent / "envs" / "arithmetic_env.py"


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(build_tiny_model())


class Replies:
    """Samples the given replies in turn (their tokens, then EOS)."""

    def __init__(self, tokenizer, replies: list[str]) -> None:
        self.tokenizer, self.replies, self.prompts = tokenizer, replies, []

    async def generate(self, request) -> TokenOutput:
        text = self.replies[len(self.prompts) % len(self.replies)]
        self.prompts.append(list(request.prompt_ids))
        tokens = self.tokenizer.encode(text, add_special_tokens=False) + [self.tokenizer.eos_token_id]
        return TokenOutput(tokens, [-0.25] * len(tokens), "completed", {"global_steps": 1})


def call(name: str, arguments: str) -> str:
    return f'<tool_call>{{"name": "{name}", "arguments": {arguments}}}</tool_call>'


def config_for(entry: str, **args) -> RolloutConfig:
    config = RolloutConfig(prompt_length=300, response_length=200, n=1)
    config.environment.kind, config.environment.id, config.environment.args = "gym", entry, args
    return config


def runner(tokenizer, replies, entry=f"{ENVS}:ArithmeticEnv", **args) -> AgentLoopRunner:
    config = config_for(entry, **args)
    scorer = RewardScorer.from_config(RewardConfig(), environment=config.environment)
    return AgentLoopRunner(Replies(tokenizer, replies), ChatFormat(tokenizer), config,
                           reward_fn=scorer.score_one)


async def test_actions_are_tool_calls_observations_mask_0_and_done_ends_the_session(tokenizer):
    loop = runner(tokenizer, [call("calculator", '{"expression": "2 * 3"}'),
                              call("calculator", '{"expression": "4 + 5"}')])
    row = DatasetRow(messages=[], uid="r0", raw={"env_kwargs": {"a": 4, "b": 5}})
    [trajectory] = await loop.run([row])
    assert isinstance(loop.loop, GymEnvironmentLoop)
    metadata = trajectory.metadata
    assert metadata["environment_reward"] == 1.5 and metadata["environment_steps"] == 2
    assert metadata["environment_done"] and trajectory.stop_reason == "completed"
    assert trajectory.reward == 1.5  # the environment's summed step rewards, weight 1
    messages = metadata["messages"]
    assert messages[0] == {"role": "user", "content": "Ann has 4 apples and gets 5 more. How many apples?"}
    assert [m["content"] for m in messages if m["role"] == "tool"] == ["6", "9"]
    # two model turns (mask 1) with the first tool turn between them (mask 0); the final
    # observation ends the episode and appends no tokens
    mask = trajectory.response_mask.tolist()
    runs = [mask[0]] + [b for a, b in zip(mask, mask[1:]) if a != b]
    assert runs == [1, 0, 1]
    tool_turn = ChatFormat(tokenizer).tool_turn_ids([{"role": "tool", "content": "6"}], True)
    start = mask.index(0)
    assert trajectory.responses.tolist()[start:start + len(tool_turn)] == tool_turn
    assert sum(1 - m for m in mask) == len(tool_turn)
    schemas = [t["function"]["name"] for t in loop.loop.tool_loop.tools.schemas()]
    assert schemas == []  # the action tool is the session's own, never the loop's
    assert "\"calculator\"" in tokenizer.decode(trajectory.prompts)


async def test_an_openenv_shaped_environment_gets_its_action_type_and_async_calls(tokenizer):
    loop = runner(tokenizer, [call("step", '{"guess": 3}'), call("step", '{"guess": "x"}'),
                              call("step", '{"guess": 7}')], entry=f"{ENVS}:OpenEnvStyleEnv")
    [trajectory] = await loop.run([DatasetRow(messages=[{"role": "system", "content": "Play."}],
                                              uid="r0")])
    tools = [m["content"] for m in trajectory.metadata["messages"] if m["role"] == "tool"]
    assert tools[0] == '{"message": "higher"}'
    assert tools[1].startswith("Error: invalid")  # "x" is no integer: the model's mistake, a result
    assert tools[2] == '{"message": "correct"}'
    assert trajectory.metadata["environment_reward"] == pytest.approx(0.9)
    assert trajectory.reward == pytest.approx(0.9)
    prompt = tokenizer.decode(trajectory.prompts)
    assert '"guess"' in prompt and '"metadata"' not in prompt  # the Action's schema as the tool's


async def test_an_environment_on_openenvs_own_classes_runs_as_a_tool_loop(tokenizer):
    """With the openenv extra installed (`make test-environments`): OpenEnv's Environment base,
    its Action subclass built from the call's arguments, its Observation read as the tool turn."""
    pytest.importorskip("openenv.core.env_server.interfaces", reason="the openenv extra: make openenv")
    entry = f"{ENVS.parent / 'openenv_guess.py'}:GuessEnv"
    loop = runner(tokenizer, [call("step", '{"guess": 9}'), call("step", '{"guess": 7}')],
                  entry=entry)
    [trajectory] = await loop.run([DatasetRow(messages=[{"role": "system", "content": "Play."}],
                                              uid="r0")])
    tools = [m["content"] for m in trajectory.metadata["messages"] if m["role"] == "tool"]
    assert tools == ['{"message": "lower"}', '{"message": "correct"}']
    assert trajectory.metadata["environment_reward"] == pytest.approx(0.9)
    prompt = tokenizer.decode(trajectory.prompts)
    assert '"guess"' in prompt and '"metadata"' not in prompt


async def test_environment_reward_weight_adds_to_the_users_reward(tokenizer):
    config = config_for(f"{ENVS}:ArithmeticEnv")
    config.environment.reward_weight = 0.5
    scorer = RewardScorer.from_config(RewardConfig(), lambda data_source, solution_str,
                                      ground_truth, extra_info=None: 2.0,
                                      environment=config.environment)
    loop = AgentLoopRunner(Replies(tokenizer, [call("calculator", '{"expression": "2 + 3"}')]),
                           ChatFormat(tokenizer), config, reward_fn=scorer.score_one)
    [trajectory] = await loop.run([DatasetRow(messages=[], uid="r0")])
    assert trajectory.reward == pytest.approx(2.0 + 0.5 * 1.0)  # one correct step: 1.0
    assert trajectory.reward_extra["reward/environment"] == 1.0


def test_step_results_of_every_shape():
    assert step_outcome(("o", 1, True, {})) == ("o", 1.0, True)
    assert step_outcome(("o", 0.5, False, True, {})) == ("o", 0.5, True)  # Gymnasium: truncated

    class StepResult:
        observation, reward, done = "o", None, False
    assert step_outcome(StepResult()) == ("o", 0.0, False)
    with pytest.raises(TypeError, match="step\\(\\) returned"):
        step_outcome("o")
    with pytest.raises(TypeError, match="reward"):
        step_outcome(("o", "high", False, {}))
    assert observation_text({"board": [1, 2]}) == '{"board": [1, 2]}'

    class Seen(BaseModel):  # an OpenEnv-style Observation: bookkeeping and unset fields unread
        text: str | None = None
        done: bool = False
        reward: float | None = None
    assert observation_text(Seen(text="hi", done=True, reward=1.0)) == '{"text": "hi"}'
    assert observation_text(Seen()) == ""  # nothing observed: no user turn of "{}"


@pytest.mark.parametrize("overrides, field", [
    (["rollout.environment.kind=gym"], "rollout.environment.id"),
    (["rollout.environment.id=x:Y"], "rollout.environment.kind"),
    (["rollout.environment.args={a: 1}"], "rollout.environment.kind: is empty, so rollout.environment.args"),
    (["rollout.environment.reward_weight=2"], "rollout.environment.kind: is empty, so rollout.environment.reward_weight"),
    (["rollout.environment.harness={id: bash}"], "rollout.environment.kind: is empty, so rollout.environment.harness"),
    (["rollout.environment.kind=gym", "rollout.environment.id=x:Y",
      "rollout.environment.reward_weight=.inf"], "rollout.environment.reward_weight"),
    (["rollout.environment.kind=other", "rollout.environment.id=x:Y"], "rollout.environment.kind"),
    (["rollout.environment.kind=gym", "rollout.environment.id=x:Y", "rollout.multi_turn.enable=true",
      "rollout.multi_turn.tools=[calculator]"], "rollout.multi_turn.enable"),
    (["rollout.environment.kind=gym", "rollout.environment.id=x:Y",
      "rollout.environment.harness={id: bash}"], "rollout.environment.harness"),
])
def test_config_errors_name_the_field(overrides, field):
    with pytest.raises(ConfigError, match=field.replace(".", "\\.")):
        load_config({}, overrides)


def test_the_preflight_finds_an_environment_that_does_not_load_before_ray():
    from tandem.preflight.names import check_names

    config = load_config({}, ["rollout.environment.kind=gym", f"rollout.environment.id={ENVS}:Nope"])
    with pytest.raises(ConfigError, match="rollout.environment.id: .*defines no 'Nope'"):
        check_names(config)
    config = load_config({}, ["rollout.environment.kind=verifiers", "rollout.environment.id=nope-env"])
    with pytest.raises(ConfigError, match="verifiers"):  # not installed, or no such taskset
        check_names(config)


def test_tools_given_with_an_environment_are_refused():
    from tandem.preflight import _check_tools
    from tandem.tools.registry import build_tool_registry

    config = load_config({}, ["rollout.environment.kind=gym", "rollout.environment.id=x:Y"])
    with pytest.raises(ConfigError, match="rollout.environment.kind: is gym.*calculator"):
        _check_tools(config, build_tool_registry(["calculator"], ()))
