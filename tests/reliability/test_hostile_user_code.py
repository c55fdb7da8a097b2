"""Issue 42, "user code that misbehaves fails its sample, never the run, and never hangs it":
rewards and tools that raise SystemExit / KeyboardInterrupt / CancelledError, never return,
swallow their cancellation, block the event loop, return odd types or 10 MB, or mutate their
arguments. Each fails its own sample (named) or is coerced; the sessions and the process go on."""

from __future__ import annotations

import asyncio
import json
import logging
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
import torch

from tandem.agent import AgentLoopRunner, DatasetRow, Session, ToolAgentLoop
from tandem.agent.dataset import row_from_record
from tandem.agent.tool_loop import TRUNCATION_MARKER, truncate_tool_text
from tandem.batch.trajectory import Trajectory
from tandem.config.schema import MultiTurnConfig, RolloutConfig
from tandem.rewards.scorer import FAILED, RewardFunction, RewardScorer
from tandem.tools.registry import ToolRegistry, ToolResult
from tandem.types import TokenOutput
from tandem.user_code import UserCodeFailed

ESCAPES = [SystemExit(3), KeyboardInterrupt(), asyncio.CancelledError(), GeneratorExit()]


def trajectory(text: str, uid: str = "u", record: dict | None = None) -> Trajectory:
    record = record or {"prompt": [{"role": "user", "content": "q?"}], "data_source": "d",
                        "ground_truth": "988", "extra_info": {"tags": ["a"]}}
    row = row_from_record(record, 0)
    return Trajectory(prompts=torch.tensor([1, 2]), responses=torch.tensor([5, 6]),
                      response_mask=torch.tensor([1.0, 1.0]), rollout_log_probs=torch.zeros(2),
                      min_global_steps=0, max_global_steps=0, uid=uid, session_id=0,
                      data_source=row.data_source, ground_truth=row.ground_truth,
                      metadata={"response_text": text, "extra_info": row.extra_info, "row": row,
                                "messages": [*row.messages, {"role": "assistant", "content": text}]})


def scores(scorer: RewardScorer, trajectories: list[Trajectory]) -> list[tuple[float, dict]]:
    asyncio.run(scorer.score(trajectories))
    return [(t.reward, t.reward_extra) for t in trajectories]


# ---- rewards -------------------------------------------------------------------------------

@pytest.mark.parametrize("escape", ESCAPES, ids=lambda e: type(e).__name__)
@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_reward_raising_what_ends_a_run_fails_only_its_sample(escape, kind, caplog):
    def sync_reward(data_source, solution_str, ground_truth, extra_info=None):
        if solution_str == "bad":
            raise escape
        return 1.0

    async def async_reward(data_source, solution_str, ground_truth, extra_info=None):
        return sync_reward(data_source, solution_str, ground_truth)

    fn = sync_reward if kind == "sync" else async_reward
    scorer = RewardScorer([RewardFunction("hostile", fn, "verl")], timeout_seconds=10)
    with caplog.at_level(logging.WARNING):
        results = scores(scorer, [trajectory("ok"), trajectory("bad", uid="bad"), trajectory("ok")])
    assert results == [(1.0, {}), (0.0, {FAILED: 1.0}), (1.0, {})]
    assert (f"reward hostile failed for bad/0 (reward 0): UserCodeFailed: reward function "
            f"hostile raised {type(escape).__name__}") in caplog.text


def test_cancelling_the_scoring_itself_still_cancels_it():
    """The session's own cancellation is not the user's CancelledError: it propagates."""
    async def slow(data_source, solution_str, ground_truth, extra_info=None):
        await asyncio.sleep(30)
        return 1.0

    async def run():
        scorer = RewardScorer([RewardFunction("slow", slow, "verl"),
                               RewardFunction("slow_sync", lambda **kw: time.sleep(30), "verl")],
                              timeout_seconds=60)
        task = asyncio.create_task(scorer.score([trajectory("x")]))
        await asyncio.sleep(0.2)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return task.cancelled()

    began = time.monotonic()
    assert asyncio.run(run())
    assert time.monotonic() - began < 5


def test_a_sync_reward_that_never_returns_fails_its_sample_and_the_process_exits():
    """The abandoned thread must not hold the interpreter's exit (the default executor's
    threads are joined at exit: asyncio.run would wait forever)."""
    script = textwrap.dedent("""
        import asyncio, threading, torch
        from tandem.agent.dataset import row_from_record
        from tandem.batch.trajectory import Trajectory
        from tandem.rewards.scorer import RewardFunction, RewardScorer

        def forever(data_source, solution_str, ground_truth, extra_info=None):
            threading.Event().wait()

        row = row_from_record({"prompt": [{"role": "user", "content": "q"}]}, 0)
        item = Trajectory(prompts=torch.tensor([1]), responses=torch.tensor([2]),
                          response_mask=torch.tensor([1.0]), rollout_log_probs=torch.zeros(1),
                          min_global_steps=0, max_global_steps=0, uid="u", session_id=0,
                          metadata={"row": row})
        scorer = RewardScorer([RewardFunction("forever", forever, "verl")], timeout_seconds=0.5)
        asyncio.run(scorer.score([item]))
        print("scored", item.reward, item.reward_extra, flush=True)
    """)
    began = time.monotonic()
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "scored 0.0 {'reward_failed': 1.0}" in done.stdout
    assert time.monotonic() - began < 40


class Ticker:
    """Counts the main event loop's turns: a frozen loop stops counting."""

    def __init__(self) -> None:
        self.longest_gap = 0.0

    async def run(self) -> None:
        last = time.monotonic()
        while True:
            await asyncio.sleep(0.02)
            now = time.monotonic()
            self.longest_gap = max(self.longest_gap, now - last)
            last = now


async def swallows_cancellation(data_source, solution_str, ground_truth, extra_info=None):
    while True:
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            pass


async def blocks_the_loop(data_source, solution_str, ground_truth, extra_info=None):
    time.sleep(4)
    return 1.0


@pytest.mark.parametrize("hostile", [swallows_cancellation, blocks_the_loop],
                         ids=lambda f: f.__name__)
def test_an_async_reward_that_ignores_its_deadline_fails_at_it_and_freezes_nothing(hostile):
    async def fine(data_source, solution_str, ground_truth, extra_info=None):
        return 0.5

    async def run():
        ticker = Ticker()
        ticking = asyncio.create_task(ticker.run())
        scorer = RewardScorer([RewardFunction("hostile", hostile, "verl")], timeout_seconds=0.5)
        began = time.monotonic()
        bad = trajectory("x")
        await scorer.score([bad])
        elapsed = time.monotonic() - began
        # a later call of well-behaved user code is not stuck behind the hostile one
        good = trajectory("y")
        await RewardScorer([RewardFunction("fine", fine, "verl")], timeout_seconds=2).score([good])
        ticking.cancel()
        return bad, good, elapsed, ticker.longest_gap

    bad, good, elapsed, gap = asyncio.run(run())
    assert (bad.reward, bad.reward_extra) == (0.0, {FAILED: 1.0})
    assert good.reward == 0.5
    assert elapsed < 0.5 + 1.5  # the deadline, plus the check that retires a stuck loop
    assert gap < 0.4  # the main loop never stood still


@pytest.mark.parametrize("value, words", [
    ({"score": 1.0, "acc": "yes"}, "returned detail 'acc'='yes' (str)"),
    ({"score": 1.0, "acc": None}, "returned detail 'acc'=None (NoneType)"),
    ({"score": 1.0, "acc": float("nan")}, "returned detail 'acc'=nan"),
    ({"score": None}, "returned score None"),
    ({"score": "1"}, "returned score '1'"),
    (1e39, "returned score 1e+39, non-finite or beyond float32's range"),
    (-1e39, "returned score -1e+39"),
    (float("nan"), "returned score nan, non-finite"),
    (float("inf"), "returned score inf, non-finite"),
    (np.float64(1e39), "returned score 1e+39"),
    (torch.tensor([0.5, 0.5]), "returned Tensor"),
    (True, "returned bool"),
])
def test_a_bad_reward_value_fails_its_sample_naming_the_function_and_key(value, words, caplog):
    scorer = RewardScorer([RewardFunction("odd", lambda **kw: value, "verl")])
    with caplog.at_level(logging.WARNING):
        assert scores(scorer, [trajectory("x")]) == [(0.0, {FAILED: 1.0})]
    assert "reward odd failed" in caplog.text and words in caplog.text


@pytest.mark.parametrize("value, expected", [
    (np.float32(0.25), (0.25, {})),
    (np.int64(2), (2.0, {})),
    (torch.tensor(0.5), (0.5, {})),
    ({"score": np.float32(1.0), "acc": np.bool_(True), "n": torch.tensor(3)},
     (1.0, {"acc": 1.0, "n": 3.0})),
    ({"score": 1.0, "acc": True, "answer": "42", "note": None}, (1.0, {"acc": 1.0, "answer": "42",
                                                                      "note": None})),
])
def test_numpy_and_torch_scalars_are_numbers_and_text_details_stay_text(value, expected):
    scorer = RewardScorer([RewardFunction("scalars", lambda **kw: value, "verl")])
    [(reward, extra)] = scores(scorer, [trajectory("x")])
    assert (reward, extra) == expected and type(reward) is float


def test_rewards_that_mutate_their_arguments_change_no_row():
    def per_sample(data_source, solution_str, ground_truth, extra_info=None):
        extra_info["tags"].append("mutated")
        extra_info["new"] = 1
        return 1.0

    def batched(prompts, completions, extra_info, **columns):
        prompts[0][0]["content"] = "mutated"
        extra_info[0]["tags"].clear()
        return [1.0] * len(prompts)

    items = [trajectory("a"), trajectory("b")]
    row = items[0].metadata["row"]
    before = json.dumps([row.messages, row.raw, row.extra_info], sort_keys=True)
    scorer = RewardScorer([RewardFunction("per_sample", per_sample, "verl"),
                           RewardFunction("batched", batched, "batched")])
    assert [reward for reward, _ in scores(scorer, items)] == [2.0, 2.0]
    assert json.dumps([row.messages, row.raw, row.extra_info], sort_keys=True) == before


# ---- tools ---------------------------------------------------------------------------------

class Hostile:
    """A tool whose execute() is given per test."""

    name = "hostile"
    description = "misbehaves"
    parameters = {"type": "object", "properties": {"what": {"type": "string"}}}

    def __init__(self, execute) -> None:
        self._execute = execute

    async def execute(self, arguments, context):
        return await self._execute(arguments, context)


@pytest.mark.parametrize("escape", ESCAPES, ids=lambda e: type(e).__name__)
async def test_a_tool_raising_what_ends_a_run_is_an_error_naming_the_tool(escape):
    async def raising(arguments, context):
        raise escape

    with pytest.raises(UserCodeFailed, match=f"tool hostile raised {type(escape).__name__}"):
        await ToolRegistry([Hostile(raising)]).call("hostile", {})


async def tool_swallows_cancellation(arguments, context):
    while True:
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            pass


async def tool_blocks_the_loop(arguments, context):
    time.sleep(4)
    return ToolResult("late")


@pytest.mark.parametrize("execute", [tool_swallows_cancellation, tool_blocks_the_loop],
                         ids=lambda f: f.__name__)
async def test_a_tool_that_ignores_its_deadline_is_stopped_there_and_freezes_nothing(execute):
    ticker = Ticker()
    ticking = asyncio.create_task(ticker.run())
    client = Client([tool_call_tokens("hostile"), DONE])
    loop = ToolAgentLoop(client, Format(), rollout_config(tool_timeout_seconds=0.5),
                         ToolRegistry([Hostile(execute)]))
    began = time.monotonic()
    result = await loop.run(Session(DatasetRow(messages=[{"role": "user", "content": "?"}],
                                               uid="u"), 0, "u-0"))
    elapsed = time.monotonic() - began
    ticking.cancel()
    tool_text = [m["content"] for m in result.metadata["messages"] if m["role"] == "tool"]
    assert tool_text == ["Error: the hostile call ran longer than 0.5 s and was stopped"]
    assert result.stop_reason == "completed" and elapsed < 0.5 + 1.5
    assert ticker.longest_gap < 0.4


async def test_a_tool_swallowing_its_cancellation_leaves_the_calls_beside_it_alone():
    """The user-code loop is replaced for later calls, never stopped: a well-behaved call
    running on it beside the hostile one finishes."""
    async def patient(arguments, context):
        await asyncio.sleep(1.5)
        return ToolResult("done")

    registry = ToolRegistry([Hostile(tool_swallows_cancellation)])
    neighbour = ToolRegistry([Hostile(patient)])
    hostile_call = asyncio.ensure_future(registry.call("hostile", {}, timeout=0.3))
    fine = await neighbour.call("hostile", {}, timeout=10)
    with pytest.raises(TimeoutError, match="returned nothing within "
                       "rollout.multi_turn.tool_timeout_seconds=0.3 s"):
        await hostile_call
    assert fine == ToolResult("done")


async def test_a_tool_returning_str_is_a_result_and_other_types_are_refused_by_name():
    async def text(arguments, context):
        return "plain"

    async def number(arguments, context):
        return 42

    assert await ToolRegistry([Hostile(text)]).call("hostile", {}) == ToolResult("plain", True)
    with pytest.raises(TypeError, match="tool hostile returned int; execute.. returns a ToolResult"):
        await ToolRegistry([Hostile(number)]).call("hostile", {})


async def test_a_tool_mutating_its_context_changes_no_row():
    async def mutate(arguments, context):
        context["seen"].append(1)
        return ToolResult("ok")

    row = DatasetRow(messages=[{"role": "user", "content": "?"}], uid="u",
                     tools_kwargs={"hostile": {"seen": []}})
    client = Client([tool_call_tokens("hostile"), DONE])
    loop = ToolAgentLoop(client, Format(), rollout_config(), ToolRegistry([Hostile(mutate)]))
    await loop.run(Session(row, 0, "u-0"))
    assert row.tools_kwargs == {"hostile": {"seen": []}}


async def test_a_session_whose_tool_raises_system_exit_fails_alone():
    async def exits_on_bad(arguments, context):
        if arguments.get("what") == "bad":
            raise SystemExit(1)
        return ToolResult("fine")

    client = Client([tool_call_tokens("hostile", "bad"), tool_call_tokens("hostile"), DONE])
    runner = AgentLoopRunner(client, Format(), rollout_config(n=2),
                             ToolRegistry([Hostile(exits_on_bad)]))
    finished = await runner.run([DatasetRow(messages=[{"role": "user", "content": "?"}], uid="p")])
    [failure] = runner.take_failures()
    assert len(finished) == 1 and isinstance(failure.error, UserCodeFailed)
    assert "tool hostile raised SystemExit" in str(failure.error)


def test_ten_megabytes_of_tool_output_are_cut_without_tokenizing_them_whole():
    from transformers import AutoTokenizer

    from tandem.agent.chat_format import ChatFormat
    from tandem.models.tiny import build_tiny_model

    chat_format = ChatFormat(AutoTokenizer.from_pretrained(build_tiny_model()))
    text = "".join(f"line {i}: {'x' * 40}\n" for i in range(250_000))  # ~12 MB
    for side in ("left", "right", "middle"):
        began = time.monotonic()
        cut = truncate_tool_text(text, 256, side, chat_format)
        assert time.monotonic() - began < 1.0
        kept = cut.replace(TRUNCATION_MARKER, "")
        assert TRUNCATION_MARKER in cut and len(chat_format.encode_text(kept)) <= 257
    assert truncate_tool_text(text, 256, "right", chat_format).startswith("line 0: xxx")
    assert truncate_tool_text(text, 256, "left", chat_format).endswith("line 249999: " + "x" * 40 + "\n")
    short = "a few words"  # what fits is never cut
    assert truncate_tool_text(short, 256, "middle", chat_format) == short


# ---- a scripted client and chat format for the tool loop -------------------------------------

EOS = 2
DONE = [9, EOS]


CALLS: list[tuple[str, str]] = []  # token 100 + i is the model's call CALLS[i]


def tool_call_tokens(name: str, what: str = "") -> list[int]:
    CALLS.append((name, what))
    return [100 + len(CALLS) - 1, EOS]


class Client:
    def __init__(self, turns: list[list[int]]) -> None:
        self.turns = list(turns)

    async def generate(self, request):
        tokens = self.turns.pop(0)
        return TokenOutput(tokens, [-0.5] * len(tokens), "completed", {"global_steps": 0})


class Format:
    stop_token_ids = frozenset([EOS])

    def prompt_ids(self, messages, tools=None, images=()):
        return [5, 6]

    def tool_turn_ids(self, tool_messages, after_stop_token):
        return [7, 8]

    def decode(self, ids):
        parts = []
        for token in ids:
            if token >= 100:
                name, what = CALLS[token - 100]
                arguments = json.dumps({"what": what} if what else {})
                parts.append(f'<tool_call>{{"name": "{name}", "arguments": {arguments}}}</tool_call>')
            elif token != EOS:
                parts.append("done")
        return "".join(parts)

    def strip_stop_text(self, text):
        return text

    def encode_text(self, text):
        return list(range(len(text.split())))

    def decode_text(self, ids):
        return " ".join("w" for _ in ids)


def rollout_config(n: int = 1, **multi_turn) -> RolloutConfig:
    return RolloutConfig(prompt_length=8, response_length=32, n=n, agent_concurrency=4,
                         multi_turn=MultiTurnConfig(enable=True, **multi_turn))


@pytest.mark.slow
def test_fit_with_hostile_rewards_finishes_and_the_process_exits(tmp_path):
    """Trainer.fit() end to end (tiny model, sync mode, Ray started and stopped by fit): one
    sample's reward never returns, another's raises SystemExit, another's KeyboardInterrupt;
    those samples fail, the step trains, fit() returns and the interpreter exits."""
    from tandem.demo.tasks import make_datasets

    train, _ = make_datasets(tmp_path / "data", 4, 1, seed=0)
    script = textwrap.dedent(f"""
        import itertools, threading
        import tandem

        calls = itertools.count()

        def hostile(data_source, solution_str, ground_truth, extra_info=None):
            call = next(calls)
            if call == 0:
                threading.Event().wait()  # never returns
            if call == 1:
                raise SystemExit(5)
            if call == 2:
                raise KeyboardInterrupt
            return 1.0

        trainer = tandem.Trainer({{}}, reward_fn=hostile, overrides=[
            "model.path=tiny:qwen2", "data.train_files=[{train}]", "data.train_batch_size=2",
            "rollout.n=2", "rollout.prompt_length=320", "rollout.response_length=8",
            "rollout.kv_cache_memory_bytes=8388608", "actor.ppo_mini_batch_size=1",
            "reward.timeout_seconds=2", "trainer.total_steps=1", "trainer.progress=false",
            "trainer.output_dir={tmp_path / 'run'}"])
        trainer.fit()
        print("fit returned", flush=True)
    """)
    began = time.monotonic()
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=400)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "fit returned" in done.stdout
    from tandem.trainer.metrics import read_metrics

    [record] = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl")
                if "reward/failed_rewards" in r]
    assert record["reward/failed_rewards"] == 3.0
    assert time.monotonic() - began < 400
