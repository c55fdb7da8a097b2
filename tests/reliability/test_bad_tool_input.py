"""Issue 28, "one bad tool input kills the run": whatever a built-in tool's evaluation raises is
a tool error the model sees (calculator: `log(1, 1)`, lone surrogates, and what fuzzing finds);
a step whose sessions all fail is skipped with a warning and a metric, and the run goes on."""

from __future__ import annotations

import asyncio
import logging

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tandem.agent.chat_format import ChatFormat
from tandem.tools.calculator import FUNCTIONS, CalculatorTool
from tandem.tools.registry import ToolRegistry, ToolResult

ATOMS = ["0", "1", "-1", "0.0", "1e308", "1e-308", "2**64", "pi", "e", "nan", "inf", "(1)",
         "True", "'a'", "\ud800", "\x00", "1j", "...", "None", "10**1233", "0.5", "[1]"]
OPERATORS = ["+", "-", "*", "/", "//", "%", "**", "<<", "@", "and", "<", ","]


def expressions():
    atoms = st.one_of(st.sampled_from(ATOMS), st.integers(-10**6, 10**6).map(str),
                      st.floats().map(repr))

    def extend(children):
        return st.one_of(
            st.tuples(children, st.sampled_from(OPERATORS), children).map(" ".join),
            st.tuples(st.sampled_from([*FUNCTIONS, "print", "__import__"]),
                      st.lists(children, max_size=3)).map(lambda t: f"{t[0]}({', '.join(t[1])})"),
            children.map(lambda child: f"-({child})"))
    return st.one_of(st.recursive(atoms, extend, max_leaves=8), st.text(max_size=60))


def calculate(expression: str) -> ToolResult:
    return asyncio.run(CalculatorTool().execute({"expression": expression}, {}))


@pytest.mark.parametrize("expression, words", [
    ("log(1, 1)", "log: float division by zero"),
    ("log(2, 1)", "log: float division by zero"),
    ("1 + \ud800", "lone UTF-16 surrogate"),
    ("\x00", "null bytes"),
])
def test_calculator_failures_are_tool_errors(expression, words):
    result = calculate(expression)
    assert not result.ok and words in result.text


@settings(max_examples=400, deadline=None, suppress_health_check=list(HealthCheck))
@given(expressions())
def test_calculator_never_raises_on_any_expression(expression):
    result = calculate(expression)
    assert isinstance(result.text, str) and result.text
    result.text.encode("utf-8")  # the model must be able to read it
    if not result.ok:
        assert result.text.startswith("Error: ")


async def test_unencodable_results_are_escaped_for_the_tokenizer():
    class Echo:
        name, description = "echo", "Echo."
        parameters = {"type": "object", "properties": {"text": {"type": "string"}}}

        async def execute(self, arguments, context):
            return ToolResult(arguments["text"])

    result = await ToolRegistry([Echo()]).call("echo", {"text": "a\ud800b"})
    assert result.text == "a\\ud800b" and result.ok


async def test_a_calculator_error_reaches_the_model_in_the_token_stream():
    """The tool loop with the real calculator and tiny tokenizer: log(1, 1) and a surrogate
    come back as tool messages, and the session finishes."""
    from transformers import AutoTokenizer

    from tandem.agent import DatasetRow, Session, ToolAgentLoop
    from tandem.config.schema import MultiTurnConfig, RolloutConfig
    from tandem.models.tiny import build_tiny_model
    from tandem.types import TokenOutput

    tokenizer = AutoTokenizer.from_pretrained(build_tiny_model())
    calls = ['{"name": "calculator", "arguments": {"expression": "log(1, 1)"}}',
             '{"name": "calculator", "arguments": {"expression": "1 + \\ud800"}}']
    turns = [tokenizer.encode(f"<tool_call>{call}</tool_call>", add_special_tokens=False)
             for call in calls] + [tokenizer.encode("done", add_special_tokens=False)]

    class Client:
        async def generate(self, request):
            request_id, prompt_ids, sampling_params = request.request_id, request.prompt_ids, request.sampling
            tokens = turns.pop(0) + [tokenizer.eos_token_id]
            return TokenOutput(tokens, [-0.5] * len(tokens), "completed", {"global_steps": 0})

    config = RolloutConfig(prompt_length=400, response_length=300, n=1, multi_turn=MultiTurnConfig(
        enable=True, tools=["calculator"], max_tool_response_length=256))
    loop = ToolAgentLoop(Client(), ChatFormat(tokenizer), config, ToolRegistry([CalculatorTool()]))
    trajectory = await loop.run(Session(DatasetRow(messages=[{"role": "user", "content": "?"}],
                                                   uid="u"), 0, "u-0"))
    assert trajectory.stop_reason == "completed" and trajectory.metadata["tool_errors"] == 2
    tools = [m["content"] for m in trajectory.metadata["messages"] if m["role"] == "tool"]
    assert "float division by zero" in tools[0] and "surrogate" in tools[1]


@pytest.mark.slow
def test_a_step_whose_sessions_all_fail_is_skipped(tmp_path, ray_cluster, caplog):
    """Sync mode, two steps: every session of the step-0 validation and of step 0 fails (its
    agent loop raises; a raising reward is only reward 0, see tests/test_rewards*); the validation
    and the step are skipped with warnings and metrics, step 1 trains, and the final validation
    runs."""
    from tandem.config.load import load_config
    from tandem.demo.tasks import make_datasets
    from tandem.trainer.metrics import read_metrics
    from tandem.trainer.rl_trainer import RLTrainer
    from tandem.trainer.sync import fit_sync

    train, val = make_datasets(tmp_path / "data", 8, 3, seed=0)
    config = load_config(overrides=[
        f"data.train_files=[{train}]", f"data.val_files=[{val}]", "data.train_batch_size=2",
        "rollout.n=2", "rollout.prompt_length=320", "rollout.response_length=8",
        "rollout.kv_cache_memory_bytes=16777216", "actor.ppo_mini_batch_size=1",
        "actor.ppo_max_token_len_per_micro_batch=2048", "trainer.total_steps=2",
        "trainer.progress=false", f"trainer.output_dir={tmp_path / 'run'}"])

    async def run():
        trainer = RLTrainer(config)
        await trainer.start()
        loop_run, calls = trainer.runner.loop.run, {"n": 0}

        async def broken_at_first(session):
            calls["n"] += 1
            if calls["n"] <= 3 + 2 * 2:  # the 3 validation rows, then step 0's 2 rows x n=2
                raise RuntimeError("agent loop down")
            return await loop_run(session)

        trainer.runner.loop.run = broken_at_first
        try:
            return trainer, await fit_sync(trainer)
        finally:
            await trainer.stop()

    with caplog.at_level(logging.WARNING):
        trainer, validation = asyncio.run(run())
    assert trainer.step == 2 and "val/reward" in validation
    assert "step 0 skipped: all 4 sessions failed" in caplog.text
    assert "validation at step 0: all 3 sessions failed" in caplog.text
    records = read_metrics(tmp_path / "run" / "metrics.jsonl")
    [skipped] = [r for r in records if "rollout/skipped_steps" in r]
    assert skipped == {"step": 1, "rollout/skipped_steps": 1.0, "rollout/failed_sessions": 4.0,
                       "weight_version": 1}
    [trained] = [r for r in records if "time/generate" in r]
    assert trained["step"] == 2 and trained["weight_version"] == 2


async def test_fit_sync_skips_a_step_whose_sessions_all_fail(tmp_path, caplog):
    """The sync loop's order with a trainer whose step 1 generation fails entirely: the step is
    skipped (RLTrainer.skip_step: warning, version moves on with a sync, metrics), the others
    train; no exception ends the run."""
    from tandem.agent.runner import AllSessionsFailed, SessionFailure
    from tandem.config.load import load_config
    from tandem.trainer.metrics import MetricsLogger, PhaseTimer, read_metrics
    from tandem.trainer.rl_trainer import RLTrainer
    from tandem.trainer.sync import fit_sync

    class Fleet:
        def __init__(self, log: list[str]) -> None:
            self.log = log

        async def wake_rollout(self, tags):
            pass

        async def sleep_rollout(self):
            pass

        async def sync_weights(self, version):
            self.log.append(f"sync {version}")
            return {}

        async def follow_schedule(self, step):  # no rollout.elastic schedule: nothing resizes
            pass

        async def wait_for_rollout(self, work):  # no health check: the work as it is
            return await work

    class Trainer:
        skip_step = RLTrainer.skip_step
        sync_weights = RLTrainer.sync_weights
        next_prompt_batch = RLTrainer.next_prompt_batch
        algorithm_name = "GRPO"

        def __init__(self) -> None:
            self.config = load_config(overrides=["trainer.total_steps=3", "trainer.progress=false"])
            self.step = self.skipped_steps = self.prompt_batch = 0
            self.first_skip = None
            self.metrics = MetricsLogger(tmp_path)
            self.log: list[str] = []
            self.fleet = Fleet(self.log)
            self.startup = type("Clock", (), {"mark": lambda _, name: None})()
            failures = [SessionFailure("u", 0, RuntimeError("reward service down"))]
            self.runner = type("Runner", (), {"take_failures": lambda _: failures})()

        async def validate_first(self, on_validation):
            return {}

        def train_rows(self, step):
            return [step]

        async def generate(self, rows, step):
            if step == 1:
                raise AllSessionsFailed("all 1 sessions failed; the first (u-0): RuntimeError: "
                                        "reward service down", [])
            return ["trajectory"]

        async def compute_rewards(self, trajectories):
            pass

        def make_batch(self, trajectories):
            return None

        async def compute_old_log_probs(self, batch):
            pass

        compute_ref_log_probs = compute_values = compute_old_log_probs

        def compute_advantages(self, batch):
            return {}

        async def update(self, batch):
            self.log.append(f"train {self.step}")
            return {}

        async def step_record(self, trajectories, batches, metrics, timer: PhaseTimer):
            return {"trained": 1.0}

        def validation_due(self):
            return False

        checkpoint_due = validation_due

        async def log_step(self, record):
            self.metrics.log(self.step, record)

        async def validate_last(self, on_validation, validation):
            return validation

    trainer = Trainer()
    with caplog.at_level(logging.WARNING):
        await fit_sync(trainer)
    assert trainer.step == 3
    assert trainer.log == ["sync 0", "train 0", "sync 1", "sync 2", "train 2", "sync 3"]
    assert "step 1 skipped: all 1 sessions failed" in caplog.text
    assert read_metrics(tmp_path / "metrics.jsonl") == [
        {"step": 1, "trained": 1.0},
        {"step": 2, "rollout/skipped_steps": 1.0, "rollout/failed_sessions": 1.0, "weight_version": 2},
        {"step": 3, "trained": 1.0}]
