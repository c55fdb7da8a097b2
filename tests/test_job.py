"""tandem.Trainer on the user's own job: a verl-style reward, a TRL-style async batched reward,
a Tool class of the user's and JSONL data, 2 GRPO steps; the final model is kept in HF format."""

import json
import shutil
import sys
import threading
from pathlib import Path

import pytest

import tandem
from tandem.config.load import ConfigError

EXAMPLE = Path(__file__).parents[1] / "examples" / "byoj"


@pytest.fixture
def example(tmp_path, monkeypatch):
    """examples/byoj copied to a scratch directory, which becomes the working directory."""
    directory = tmp_path / "byoj"
    shutil.copytree(EXAMPLE, directory)
    monkeypatch.chdir(directory)
    monkeypatch.syspath_prepend(str(directory))
    yield directory
    for name in ("my_reward", "my_tools"):
        sys.modules.pop(name, None)


def job(directory: Path, **trainer) -> dict:
    return {"model": {"path": "tiny:calculator"},
            "rollout": {"n": 4, "prompt_length": 256, "response_length": 48,
                        "kv_cache_memory_bytes": 64 << 20,
                        "multi_turn": {"enable": True, "max_assistant_turns": 2,
                                       "max_user_turns": 1}},
            "actor": {"ppo_mini_batch_size": 2, "optim": {"lr": 1e-4}},
            "data": {"train_files": [str(directory / "data/train.jsonl")],
                     "val_files": [str(directory / "data/val.jsonl")], "train_batch_size": 2},
            "trainer": {"total_steps": 2, "output_dir": str(directory / "run"), "progress": False,
                        **trainer}}


def test_trainer_fits_the_users_reward_tool_and_data(example, ray_cluster):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from my_reward import compute_score
    from my_tools import Arithmetic

    seen = {"verl": 0, "batched": 0, "train": 0}
    lock = threading.Lock()  # sync rewards run in threads

    def verl_reward(data_source, solution_str, ground_truth, extra_info=None):
        assert data_source == "my_word_problems"  # not a built-in source: the user's fn scores it
        with lock:
            seen["verl"] += 1
            seen["train"] += extra_info["split"] == "train"
            first_training_sample = extra_info["split"] == "train" and seen["train"] == 1
        if first_training_sample:
            raise ValueError("a reward that breaks on one sample")
        return compute_score(data_source, solution_str, ground_truth, extra_info)

    async def brevity(prompts, completions, reward_model, **columns):
        seen["batched"] += len(completions)
        assert all(p[0]["role"] == "system" for p in prompts)
        assert all("ground_truth" in r for r in reward_model)
        return [-0.001 * len(c[-1]["content"]) for c in completions]

    Arithmetic.calls = 0
    trainer = tandem.Trainer(job(example, loggers=["console", "jsonl"]), reward_fn=verl_reward,
                             reward_funcs=[brevity], tools=[Arithmetic()])
    validation = trainer.fit()
    assert {"val/reward", "val/acc", "val/tool_use"} <= set(validation)
    assert seen["verl"] > 0 and seen["batched"] == seen["verl"]
    assert Arithmetic.calls > 0
    records = [json.loads(line) for line in (example / "run/metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "time/generate" in r]
    assert [r["step"] for r in steps] == [1, 2]
    # the sample whose reward raised got reward 0 and was counted; the batch trained on
    assert [r["reward/failed_rewards"] for r in steps] == [1.0, 0.0]
    assert all(r["val/failed_sessions"] == 0 for r in records if "val/failed_sessions" in r)
    # the last step is saved whatever save_freq is: HF model + tokenizer
    assert trainer.model_dir == example / "run/checkpoints/step_2/actor"
    model = AutoModelForCausalLM.from_pretrained(trainer.model_dir)
    tokenizer = AutoTokenizer.from_pretrained(trainer.model_dir)
    assert model.config.vocab_size >= len(tokenizer)


def test_trainer_checks_the_job_before_ray_starts(example, monkeypatch):
    import ray

    monkeypatch.setattr(ray, "init", lambda *a, **k: pytest.fail("Ray started"))
    with pytest.raises(ConfigError, match="rollout.multi_turn.tools: is empty"):
        tandem.Trainer(job(example), reward_fn=lambda **kw: 0.0)  # the tool loop without tools
    with pytest.raises(ConfigError, match="no reward function for data_source 'my_word_problems'"):
        tandem.Trainer(job(example), tools=[__import__("my_tools").Arithmetic()])
    config = job(example)
    config["rollout"]["multi_turn"] = {"enable": False}
    with pytest.raises(ConfigError, match="rollout.multi_turn.enable: is false, so the tools"):
        tandem.Trainer(config, reward_fn=lambda **kw: 0.0, tools=[__import__("my_tools").Arithmetic()])
    with pytest.raises(ConfigError, match="Did you mean trainer.total_steps"):
        tandem.Trainer({**job(example), "trainer": {"total_training_steps": 3}})


def test_public_api_is_importable_without_torch():
    import subprocess

    code = ("import sys, tandem\n"
            "assert 'torch' not in sys.modules and 'ray' not in sys.modules\n"
            "from tandem import load_config, Trainer, Tool, ToolResult, RewardResult, TokenOutput\n"
            "print(tandem.__version__)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == tandem.__version__
    version = subprocess.run([sys.executable, "-m", "tandem.cli", "--version"], capture_output=True,
                             text=True, timeout=120)
    assert version.stdout.strip() == f"tandem {tandem.__version__}"

