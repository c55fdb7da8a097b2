"""`tandem train` on environments: a Gym-style environment made in the tests (its action is the
calculator call tiny:calculator learned) and, where the `openenv` and `verifiers` packages are
installed (`make test-environments`), one on OpenEnv's classes and a verifiers environment. Each trains 2 steps; the environment's rewards reach
metrics.jsonl."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from tandem.cli import main
from tandem.demo.tasks import SYSTEM_PROMPT
from tandem.trainer.metrics import read_metrics

pytestmark = pytest.mark.slow  # about 50 s each on 2 cores (make test-slow, make test-verifiers)
ENVS = Path(__file__).parents[1] / "envs"
TINY = {
    "model": {"path": "tiny:calculator"},
    "rollout": {"n": 2, "prompt_length": 200, "response_length": 160, "kv_cache_memory_bytes": 16777216,
                "multi_turn": {"max_assistant_turns": 3}},
    "actor": {"ppo_mini_batch_size": 2, "ppo_max_token_len_per_micro_batch": 2048, "optim": {"lr": 0.05}},
    "data": {"train_batch_size": 2},
    "trainer": {"total_steps": 2, "progress": False},
}


def train(directory: Path, environment: dict, rows: list[dict], *overrides: str) -> list[dict]:
    """`tandem train` for 2 steps on `rows`; the training records of metrics.jsonl."""
    data = directory / "train.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    config = {**TINY, "rollout": {**TINY["rollout"], "environment": environment},
              "data": {**TINY["data"], "train_files": [str(data)]},
              "trainer": {**TINY["trainer"], "output_dir": str(directory / "run")}}
    path = directory / "config.yaml"
    OmegaConf.save(OmegaConf.create(config), path)
    main(["train", str(path), *overrides])
    return [r for r in read_metrics(directory / "run" / "metrics.jsonl") if "time/generate" in r]


def test_a_gym_environment_trains_two_steps_and_its_rewards_reach_the_metrics(tmp_path, ray_cluster):
    rows = [{"prompt": [{"role": "system", "content": "Use the calculator tool, then give the "
                                                      "final number."}],
             "env_kwargs": {"a": a, "b": b}} for a, b in ((213, 345), (708, 151), (432, 404), (911, 123))]
    records = train(tmp_path, {"kind": "gym", "id": f"{ENVS / 'arithmetic_env.py'}:ArithmeticEnv"},
                    rows)
    assert [r["step"] for r in records] == [1, 2]
    for record in records:  # a step that runs earns 0.5, a right sum 0.5 more (2 steps at most)
        assert 0.0 <= record["reward/mean"] <= 2.0
        assert record["actor/grad_norm"] >= 0
    assert any(r["reward/tool_use"] > 0 for r in records)  # the model called the action
    assert any(r["reward/mean"] > 0 for r in records), records  # the environment's reward


def test_an_openenv_environment_trains_two_steps_and_its_rewards_reach_the_metrics(tmp_path,
                                                                                   ray_cluster):
    pytest.importorskip("openenv.core.env_server.interfaces", reason="the openenv extra: make openenv")
    # the question in the row (reset observes nothing), the numbers also given to reset()
    rows = [{"prompt": [{"role": "system", "content": SYSTEM_PROMPT},
                        {"role": "user", "content": f"Ann has {a} apples and gets {b} more. "
                                                    "How many apples?"}],
             "env_kwargs": {"a": a, "b": b}} for a, b in ((213, 345), (708, 151), (432, 404), (911, 123))]
    records = train(tmp_path, {"kind": "gym", "id": f"{ENVS / 'openenv_guess.py'}:SumEnv"}, rows)
    assert [r["step"] for r in records] == [1, 2]
    assert all(0.0 <= r["reward/mean"] <= 2.0 for r in records)
    assert any(r["reward/tool_use"] > 0 for r in records)  # the model's call became an Action
    assert any(r["reward/mean"] > 0 for r in records), records  # the Observation's reward


def test_a_verifiers_environment_trains_two_steps_token_exact(tmp_path, ray_cluster, monkeypatch):
    pytest.importorskip("verifiers.v1")
    monkeypatch.syspath_prepend(str(ENVS))  # installs the test environment tandem_sums
    rows = [{"task": index} for index in range(4)]  # the task brings its prompt
    records = train(tmp_path, {"kind": "verifiers", "id": "tandem-sums", "args": {"count": 4}},
                    rows, "trainer.debug.save_rollouts=" + str(tmp_path / "rollouts"))
    assert [r["step"] for r in records] == [1, 2]
    for record in records:  # the rubric gives 0.25 for a reply, 1 for the right sum
        assert 0.25 <= record["reward/mean"] <= 1.0
        assert record["reward/forked"] == 0.0 and record["reward/split"] == 0.0
    import torch

    for step in (1, 2):  # mask 1 exactly on what the policy sampled: its two replies
        saved = torch.load(tmp_path / "rollouts" / f"step_{step:06d}.pt", weights_only=False)
        for sample in saved["trajectories"]:
            metadata = sample["metadata"]
            metadata = json.loads(metadata) if isinstance(metadata, str) else metadata
            mask = sample["response_mask"].tolist()
            runs = [mask[0]] + [b for a, b in zip(mask, mask[1:]) if a != b]
            assert runs == [1, 0, 1] and metadata["assistant_turns"] == 2
            policy = [sample["rollout_log_probs"][i].item() for i, m in enumerate(mask) if m]
            context = [sample["rollout_log_probs"][i].item() for i, m in enumerate(mask) if not m]
            assert all(value < 0 for value in policy) and set(context) == {0.0}
