"""End-to-end runs of the `tandem` CLI on a tiny model: a YAML config, a few overrides, and the
metrics.jsonl the run writes. Each named run happens once per test module."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from tandem.cli import main
from tandem.demo.tasks import make_datasets, write_jsonl
from tandem.rewards import RewardResult, register_reward
from tandem.trainer.metrics import read_metrics


@register_reward("e2e_parity")
def parity_reward(response_text, ground_truth, extra_info):
    """A reward with variance even for a random model: 1 when the reply has an even length."""
    score = float(len(response_text) % 2 == 0)
    return RewardResult(score, {"acc": score})


# 2 prompts x n=2 per step and a mini-batch of the whole batch: one optimizer step per training
# step, so step 1 trains the initial weights and step 2's samples come from the updated ones.
TINY = {
    "model": {"path": "tiny:qwen2"},
    "rollout": {"n": 2, "prompt_length": 320, "response_length": 12, "kv_cache_memory_bytes": 16777216,
                "multi_turn": {"enable": True, "tools": ["calculator"], "max_tool_response_length": 8}},
    "actor": {"ppo_mini_batch_size": 2, "ppo_max_token_len_per_micro_batch": 2048, "optim": {"lr": 0.05}},
    "data": {"train_batch_size": 2},
    "trainer": {"total_steps": 2, "progress": False},
}


@dataclass
class Run:
    """A finished `tandem train`: its config file, output directory and metrics by step."""

    config_path: Path
    output_dir: Path
    training: dict[int, dict]  # step -> the training record of that step
    validation: dict[int, dict]  # step -> the validation-only record (before training, at the end)


def write_tiny_config(directory: Path) -> Path:
    """config.yaml for the tiny model on 8 word problems and 3 held-out ones (parity reward)."""
    train, val = make_datasets(directory / "data", 8, 3, seed=0)
    for path in (train, val):
        rows = [{**json.loads(line), "data_source": "e2e_parity"} for line in path.read_text().splitlines()]
        write_jsonl(rows, path)
    config = {**TINY, "data": {**TINY["data"], "train_files": [str(train)], "val_files": [str(val)]},
              "trainer": {**TINY["trainer"], "output_dir": str(directory / "run")}}
    path = directory / "config.yaml"
    OmegaConf.save(OmegaConf.create(config), path)
    return path


def split_records(path: Path) -> tuple[dict[int, dict], dict[int, dict]]:
    """metrics.jsonl -> ({step: training record}, {step: validation-only record})."""
    training, validation = {}, {}
    for record in read_metrics(path):
        (training if "time/update" in record else validation)[record["step"]] = record
    return training, validation


@pytest.fixture(scope="module")
def tiny_runs(tmp_path_factory, ray_cluster):
    """runs(name, *overrides) -> Run of `tandem train config.yaml *overrides`, once per module
    for each name (call it with the same overrides every time)."""
    done: dict[str, Run] = {}

    def runs(name: str, *overrides: str) -> Run:
        if name not in done:
            directory = tmp_path_factory.mktemp(name)
            config_path = write_tiny_config(directory)
            main(["train", str(config_path), *overrides])
            done[name] = Run(config_path, directory / "run",
                             *split_records(directory / "run" / "metrics.jsonl"))
        return done[name]

    return runs

