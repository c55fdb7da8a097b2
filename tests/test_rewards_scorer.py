"""Rewards as users write them: verl's compute_score, TRL's batched functions, async ones,
weights, timeouts and per-sample failure (tandem.rewards.scorer)."""

import asyncio
import logging
import textwrap
import threading

import pytest
import torch

from tandem.agent.dataset import row_from_record
from tandem.batch.trajectory import Trajectory
from tandem.config.load import ConfigError, load_config
from tandem.config.schema import RewardConfig
from tandem.rewards import registry
from tandem.rewards.scorer import FAILED, RewardFunction, RewardScorer


def trajectory(text: str, ground_truth="988", data_source="anything", uid="u", session=0):
    record = {"prompt": [{"role": "user", "content": "q?"}], "data_source": data_source,
              "ground_truth": ground_truth, "level": 3}
    row = row_from_record(record, 0)
    responses = torch.tensor([5, 6, 7])
    return Trajectory(prompts=torch.tensor([1, 2]), responses=responses,
                      response_mask=torch.tensor([1.0, 0.0, 1.0]),
                      rollout_log_probs=torch.zeros(3), min_global_steps=0, max_global_steps=0,
                      uid=uid, session_id=session, data_source=data_source,
                      ground_truth=ground_truth,
                      metadata={"response_text": text, "extra_info": {"split": "train"}, "row": row,
                                "messages": [*row.messages, {"role": "assistant", "content": text}]})


def score(scorer, trajectories):
    asyncio.run(scorer.score(trajectories))
    return [(t.reward, t.reward_extra) for t in trajectories]


def test_verl_compute_score_scores_every_row_with_its_arguments():
    seen = []

    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        seen.append((data_source, solution_str, ground_truth, extra_info))
        return {"score": float(ground_truth in solution_str), "acc": 0.5}

    scorer = RewardScorer([RewardFunction("compute_score", compute_score, "verl")])
    results = score(scorer, [trajectory("it is 988"), trajectory("no", data_source="unknown_source")])
    assert results == [(1.0, {"acc": 0.5}), (0.0, {"acc": 0.5})]
    assert seen[0] == ("anything", "it is 988", "988", {"split": "train"})
    assert seen[1][0] == "unknown_source"  # no built-in needed: the user's function scores it


def test_verl_solution_str_is_the_decoded_response_when_a_decoder_is_given():
    scorer = RewardScorer([RewardFunction("f", lambda **kw: float(kw["solution_str"] == "5,6,7"),
                                          "verl")], decode=lambda ids: ",".join(map(str, ids)))
    assert score(scorer, [trajectory("ignored")])[0][0] == 1.0


def test_trl_batched_reward_gets_prompts_completions_and_columns():
    calls = []

    def lengths(prompts, completions, ground_truth, level, completion_ids, **kwargs):
        calls.append((prompts, completions, ground_truth, level, completion_ids, sorted(kwargs)))
        return [float(len(c[0]["content"])) for c in completions]

    scorer = RewardScorer([RewardFunction("lengths", lengths, "batched")])
    results = score(scorer, [trajectory("abc"), trajectory("abcdef")])
    assert [r for r, _ in results] == [3.0, 6.0]
    prompts, completions, truth, level, ids, others = calls[0]  # one call for the whole batch
    assert len(calls) == 1
    assert prompts == [[{"role": "user", "content": "q?"}]] * 2
    assert completions[1] == [{"role": "assistant", "content": "abcdef"}]
    assert truth == ["988", "988"] and level == [3, 3]
    assert ids == [[5, 7], [5, 7]]  # the policy's tokens only (mask 1)
    assert "prompt" not in others and "data_source" in others


def test_async_functions_are_awaited_and_weights_combine():
    async def per_sample(data_source, solution_str, ground_truth, extra_info=None):
        await asyncio.sleep(0)
        return 1.0

    async def batched(prompts, completions, **columns):
        await asyncio.sleep(0)
        return [0.5 for _ in completions]

    scorer = RewardScorer([RewardFunction("per_sample", per_sample, "verl", weight=2.0),
                           RewardFunction("batched", batched, "batched", weight=-1.0)])
    reward, extra = score(scorer, [trajectory("x")])[0]
    assert reward == 2.0 * 1.0 - 1.0 * 0.5
    assert extra == {"reward/per_sample": 1.0, "reward/batched": 0.5}


def test_a_raising_reward_fails_only_its_sample(caplog):
    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        if solution_str == "boom":
            raise RuntimeError("parser crashed")
        return 1.0

    scorer = RewardScorer([RewardFunction("compute_score", compute_score, "verl")])
    with caplog.at_level(logging.WARNING):
        results = score(scorer, [trajectory("ok"), trajectory("boom", uid="bad"), trajectory("ok")])
    assert results == [(1.0, {}), (0.0, {FAILED: 1.0}), (1.0, {})]
    assert "reward compute_score failed for bad/0 (reward 0): RuntimeError: parser crashed" in caplog.text


def test_a_raising_batched_reward_is_retried_per_sample_to_fail_only_the_bad_one():
    calls = []

    def batched(prompts, completions, **columns):
        calls.append(len(completions))
        if any(c[0]["content"] == "boom" for c in completions):
            raise ValueError("bad completion")
        return [1.0] * len(completions)

    scorer = RewardScorer([RewardFunction("batched", batched, "batched")])
    results = score(scorer, [trajectory("ok"), trajectory("boom"), trajectory("ok")])
    assert [r for r, _ in results] == [1.0, 0.0, 1.0]
    assert results[1][1] == {FAILED: 1.0}
    assert calls == [3, 1, 1, 1]


@pytest.mark.parametrize("values", [[], "1.0", [1.0, 2.0, 3.0], ["x"] * 2])
def test_a_batched_reward_of_the_wrong_shape_fails_its_samples(values):
    scorer = RewardScorer([RewardFunction("bad", lambda prompts, completions, **c: values, "batched")])
    results = score(scorer, [trajectory("a"), trajectory("b")])
    assert results == [(0.0, {FAILED: 1.0})] * 2


def test_a_batched_none_counts_as_zero():
    scorer = RewardScorer([RewardFunction("maybe", lambda prompts, completions, **c: [None, 2.0],
                                          "batched")])
    assert [r for r, _ in score(scorer, [trajectory("a"), trajectory("b")])] == [0.0, 2.0]


def test_a_sync_reward_runs_off_the_event_loop():
    released = threading.Event()

    def waits_for_the_loop(data_source, solution_str, ground_truth, extra_info=None):
        # only a task on the event loop sets the event: a reward run on the loop would deadlock
        return float(released.wait(timeout=30))

    async def run():
        scorer = RewardScorer([RewardFunction("w", waits_for_the_loop, "verl")], timeout_seconds=60)
        item = trajectory("x")
        scoring = asyncio.create_task(scorer.score([item]))
        await asyncio.sleep(0.01)
        released.set()
        await scoring
        return item.reward

    assert asyncio.run(run()) == 1.0


def test_a_reward_over_its_timeout_fails_that_sample():
    async def slow(data_source, solution_str, ground_truth, extra_info=None):
        await asyncio.sleep(30)
        return 1.0

    scorer = RewardScorer([RewardFunction("slow", slow, "verl")], timeout_seconds=0.05)
    assert score(scorer, [trajectory("x")]) == [(0.0, {FAILED: 1.0})]


@pytest.mark.parametrize("value, words", [
    ({"acc": 1.0}, "without 'score'"), ("1", "returned str"), (float("nan"), "non-finite"),
])
def test_a_bad_return_value_fails_the_sample(value, words, caplog):
    scorer = RewardScorer([RewardFunction("f", lambda **kw: value, "verl")])
    with caplog.at_level(logging.WARNING):
        assert score(scorer, [trajectory("x")]) == [(0.0, {FAILED: 1.0})]
    assert words in caplog.text


def write_module(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def test_config_names_a_verl_function_by_file_and_batched_ones_by_module(tmp_path, monkeypatch):
    verl = write_module(tmp_path, "my_reward.py", """
        def my_score(data_source, solution_str, ground_truth, extra_info=None):
            return float(solution_str.endswith(ground_truth))
    """)
    write_module(tmp_path, "my_trl_rewards.py", """
        def short(prompts, completions, **columns):
            return [1.0 if len(c[0]["content"]) < 5 else 0.0 for c in completions]
    """)
    monkeypatch.syspath_prepend(str(tmp_path))
    config = load_config({"reward": {"custom_function": {"path": str(verl), "name": "my_score"},
                                     "reward_funcs": ["my_trl_rewards:short"],
                                     "weights": [1.0, 0.25]}})
    scorer = RewardScorer.from_config(config.reward)
    assert [(f.name, f.kind, f.weight) for f in scorer.functions] == [
        ("my_score", "verl", 1.0), ("short", "batched", 0.25)]
    assert not scorer.uses_registry
    assert score(scorer, [trajectory("988"), trajectory("is 988")])[0][0] == 1.25
    assert score(scorer, [trajectory("is 988")])[0][0] == 1.0


@pytest.mark.parametrize("reward, words", [
    ({"custom_function": {"path": "nowhere.py"}}, "reward.custom_function: 'nowhere.py:compute_score': no file"),
    ({"custom_function": {"path": "tandem.rewards.arithmetic", "name": "missing"}},
     "defines no 'missing'"),
    ({"reward_funcs": ["no_such_module_xyz:f"]}, "reward.reward_funcs: 'no_such_module_xyz:f': cannot import"),
    ({"reward_funcs": ["justaname"]}, "is not of the form"),
    ({"custom_function": {"path": "tandem.rewards.arithmetic", "name": "final_answer_text"},
      "weights": [1.0, 2.0]}, "reward.weights has 2 entries but there are 1 reward functions"),
])
def test_bad_reward_entries_fail_before_the_run_naming_the_field(reward, words):
    config = load_config({"reward": reward})  # the preflight and Trainer build the scorer
    with pytest.raises(ConfigError, match=words):
        RewardScorer.from_config(config.reward)


def test_python_and_config_per_sample_functions_are_not_both_taken():
    config = RewardConfig()
    config.custom_function.path = "tandem.rewards.arithmetic"
    config.custom_function.name = "final_answer_text"
    with pytest.raises(ConfigError, match="name one per-sample reward function"):
        RewardScorer.from_config(config, reward_fn=lambda **kw: 1.0)


def test_without_user_functions_the_registry_scores_by_data_source():
    scorer = RewardScorer.from_config(RewardConfig())
    assert scorer.uses_registry
    results = score(scorer, [trajectory("The answer is 988.", data_source="arithmetic"),
                             trajectory("x", data_source="no_such_source")])
    assert results[0] == (1.0, {"acc": 1.0, "answer": "988"})
    assert results[1] == (0.0, {FAILED: 1.0})  # an unknown source fails that sample only


@pytest.fixture
def restore_arithmetic():
    saved = (dict(registry._REWARDS), dict(registry._CHECKS), set(registry._USER_SOURCES))
    yield
    registry._REWARDS.clear()
    registry._REWARDS.update(saved[0])
    registry._CHECKS.clear()
    registry._CHECKS.update(saved[1])
    registry._USER_SOURCES.clear()
    registry._USER_SOURCES.update(saved[2])


def test_a_user_registration_wins_over_the_built_in_and_says_so(restore_arithmetic, caplog):
    registry.reward_names()  # the built-ins are loaded
    with caplog.at_level(logging.WARNING):
        @registry.register_reward("arithmetic")
        def mine(response_text, ground_truth, extra_info):
            return registry.RewardResult(0.25)

    assert caplog.text.count("replaces tandem's built-in") == 1
    assert registry.compute_reward("arithmetic", "The answer is 988.", "988").score == 0.25
    # a later import of the built-in module does not take the name back
    import importlib

    import tandem.rewards.arithmetic as builtin
    importlib.reload(builtin)
    assert registry.compute_reward("arithmetic", "The answer is 988.", "988").score == 0.25


def test_a_custom_function_says_once_that_it_replaces_a_built_in(caplog):
    scorer = RewardScorer([RewardFunction("compute_score", lambda **kw: 1.0, "verl")])
    with caplog.at_level(logging.WARNING):
        score(scorer, [trajectory("x", data_source="arithmetic") for _ in range(3)])
        score(scorer, [trajectory("x", data_source="arithmetic")])
    assert caplog.text.count("scores these rows instead of tandem's built-in") == 1
