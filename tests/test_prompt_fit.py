"""Prompts that cannot fit rollout.prompt_length are found before Ray starts (every row rendered
as the loop renders it: chat template and tool schemas), or dropped with
data.filter_overlong_prompts; a run that trains no step fails instead of ending like a finished one."""

import asyncio
import json

import pytest

from tandem.agent.chat_format import ChatFormat
from tandem.agent.dataset import PromptDataset
from tandem.agent.prompt_fit import loop_tool_schemas, overlong_rows
from tandem.config.choices import ConfigError
from tandem.config.load import load_config, to_yaml
from tandem.demo.tasks import make_datasets, write_jsonl
from tandem.preflight import check_job, check_prompts


def job(tmp_path, *extra, long_rows=2):
    """8 training rows, the first `long_rows` padded with 400 words (far over 320 tokens)."""
    train, val = make_datasets(tmp_path / "data", 8, 2, seed=0)
    rows = [json.loads(line) for line in train.read_text().splitlines()]
    for row in rows[:long_rows]:
        row["prompt"][-1]["content"] += " apples" * 400
    write_jsonl(rows, train)
    return load_config(overrides=[
        "model.path=tiny:qwen2", f"data.train_files=[{train}]", f"data.val_files=[{val}]",
        "data.train_batch_size=2", "rollout.n=2", "rollout.prompt_length=320",
        "rollout.response_length=12", "rollout.multi_turn.enable=true",
        "rollout.multi_turn.tools=[calculator]", "rollout.kv_cache_memory_bytes=16777216",
        "actor.ppo_mini_batch_size=1", "actor.ppo_max_token_len_per_micro_batch=2048",
        "trainer.total_steps=2", "trainer.progress=false",
        f"trainer.output_dir={tmp_path / 'run'}", *extra])


def test_rows_are_measured_as_the_tool_loop_renders_them(tmp_path):
    from transformers import AutoTokenizer

    from tandem.models.tiny import resolve_model_path
    from tandem.tools.registry import build_tool_registry

    config = job(tmp_path)
    chat_format = ChatFormat(AutoTokenizer.from_pretrained(resolve_model_path("tiny:qwen2")))
    dataset = PromptDataset.from_config(config.data)
    schemas = loop_tool_schemas(config.rollout, None)
    assert schemas == build_tool_registry(["calculator"]).schemas()  # what the loop renders
    found = overlong_rows(dataset, chat_format, schemas, config.rollout.prompt_length)
    assert [position for position, _ in found] == [0, 1]
    exact = len(chat_format.prompt_ids(dataset.rows[0].messages, schemas))
    assert found[0][1] == exact > 320
    short = len(chat_format.prompt_ids(dataset.rows[2].messages, schemas))
    assert overlong_rows(dataset, chat_format, schemas, short - 1)[2] == (2, short)  # the bound is strict


def test_an_overlong_prompt_is_refused_before_ray_naming_the_row_and_length(tmp_path):
    config = job(tmp_path)
    check_job(config)  # the torch-free checks pass; the prompts are the tokenizer's business
    with pytest.raises(ConfigError) as error:
        check_prompts(config)
    message = str(error.value)
    assert message.startswith("rollout.prompt_length: 2 of the 8 rows of data.train_files")
    assert f"{config.data.train_files[0]}: row 0) at " in message
    assert "data.filter_overlong_prompts=true" in message


def test_with_the_filter_the_preflight_keeps_the_rows_that_fit_unless_none_does(tmp_path, caplog):
    check_prompts(job(tmp_path, "data.filter_overlong_prompts=true"))
    assert "dropping 2 of the 8 rows of data.train_files" in caplog.text
    with pytest.raises(ConfigError, match=r"8 of the 8 rows .* none is left"):
        check_prompts(job(tmp_path, "data.filter_overlong_prompts=true", long_rows=8))
    with pytest.raises(ConfigError, match=r"data\.train_batch_size: is 8, more than the 6 rows "
                                          r"of data\.train_files that fit"):
        check_prompts(job(tmp_path, "data.filter_overlong_prompts=true", "data.train_batch_size=8"))


def test_the_python_api_and_the_cli_check_the_prompts_before_ray(tmp_path):
    import subprocess
    import sys

    from tandem import Trainer

    config = job(tmp_path)
    with pytest.raises(ConfigError, match=r"^rollout\.prompt_length: 2 of the 8 rows"):
        Trainer(config)  # its constructor checks and never starts Ray (fit() does)
    from tandem.config.load import to_yaml

    (tmp_path / "job.yaml").write_text(to_yaml(config))
    done = subprocess.run([sys.executable, "-m", "tandem.cli", "train", str(tmp_path / "job.yaml")],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "rollout.prompt_length: 2 of the 8 rows of data.train_files" in done.stderr
    assert "Started a local Ray instance" not in done.stderr


def test_with_the_filter_the_run_trains_on_the_rows_that_fit(tmp_path, ray_cluster):
    from tandem.trainer.modes import fit
    from tandem.trainer.rl_trainer import RLTrainer

    config = job(tmp_path, "data.filter_overlong_prompts=true")

    async def run():
        trainer = RLTrainer(config)
        assert len(trainer.train_data) == 6 and trainer.steps_per_epoch == 3
        await trainer.start()
        try:
            await fit(trainer)
        finally:
            await trainer.stop()
        return trainer

    trainer = asyncio.run(run())
    assert trainer.updates == 2 and trainer.skipped_steps == 0


def test_a_run_that_trains_no_step_fails_naming_why(tmp_path, ray_cluster):
    """Built past the preflight (as bench scripts and the Python API's RLTrainer are), every
    session fails on its prompt length: the run raises instead of returning as if finished."""
    from tandem.trainer.modes import fit
    from tandem.trainer.rl_trainer import NoStepTrained, RLTrainer

    config = job(tmp_path, long_rows=8)

    async def run():
        trainer = RLTrainer(config)
        await trainer.start()
        try:
            await fit(trainer)
        finally:
            await trainer.stop()

    with pytest.raises(NoStepTrained, match=r"no step trained: all 2 step\(s\) .* the first: "
                                            r"step 1: .*rollout\.prompt_length=320"):
        asyncio.run(run())


def test_tandem_train_that_trains_no_step_exits_non_zero_naming_why(tmp_path, ray_cluster, capsys):
    """From the CLI: a reward that never varies, under dynamic sampling with a budget of one prompt
    batch, leaves no group to train on in any step; `tandem train` exits 1 naming why (not 0)."""
    from tandem.cli import main

    (tmp_path / "flat_reward.py").write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return 0.0\n")
    config = job(tmp_path, f"reward.custom_function.path={tmp_path / 'flat_reward.py'}",
                 "reward.custom_function.name=compute_score", "algorithm.filter_groups.enable=true",
                 "algorithm.filter_groups.max_gen_batches=1", long_rows=0)
    (tmp_path / "job.yaml").write_text(to_yaml(config))
    with pytest.raises(SystemExit) as exit:
        main(["train", str(tmp_path / "job.yaml")])
    assert exit.value.code == 1
    error = capsys.readouterr().err
    assert "tandem train: error: NoStepTrained: no step trained: all 2 step(s)" in error, error
    assert "algorithm.filter_groups" in error and not (tmp_path / "run" / "checkpoints").exists()
