"""Issue 28, "late or raw errors": every check that can run before Ray starts does, and the CLI
reports it as one message with exit status 2 before torch, Ray or transformers are imported:
seeds beyond int64, top_k beyond the vocabulary, lengths beyond the model's context (read from
config.json), an unloadable model.path, an output_dir that is a file, a batch larger than the
dataset, NCCL on a CPU run, an unknown engine_kwargs key, a checkpoint of another model."""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import pytest
from test_cli_errors import ROW, run_cli, write_rows

from tandem.config import ConfigError
from tandem.config.load import load_config
from tandem.preflight import check_model, check_model_fit
from tandem.weight_sync.registry import (ENGINE_KWARGS, get_checkpoint_engine_class,
                                         unavailable_checkpoint_engines)


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    write_rows(tmp_path / "train.jsonl", [ROW] * 8)
    (tmp_path / "config.yaml").write_text(
        "data:\n  train_files: [train.jsonl]\n  train_batch_size: 8\n"
        "trainer:\n  output_dir: run\n")
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({
        "model_type": "qwen2", "hidden_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128,
        "vocab_size": 1000, "max_position_embeddings": 1024}))
    (model / "tokenizer.json").write_text("{}")
    header = json.dumps({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}).encode()
    (model / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header + bytes(16))
    (tmp_path / "a_file").write_text("not a directory")
    return tmp_path


def lfs_pointer(run_dir: Path) -> str:
    (run_dir / "model" / "model.safetensors").write_text(
        "version https://git-lfs.github.com/spec/v1\noid sha256:ab\nsize 12345\n")
    return "model.path=model"


def truncated(run_dir: Path) -> str:
    path = run_dir / "model" / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-4])
    return "model.path=model"


def no_tokenizer(run_dir: Path) -> str:
    (run_dir / "model" / "tokenizer.json").unlink()
    return "model.path=model"


def another_model_checkpoint(run_dir: Path) -> str:
    step = run_dir / "run" / "checkpoints" / "step_3" / "actor"
    step.mkdir(parents=True)
    (step / "config.json").write_text(json.dumps({"model_type": "qwen2", "hidden_size": 256,
                                                  "num_hidden_layers": 2}))
    (run_dir / "run" / "checkpoints" / "latest").write_text("3")
    return "trainer.resume=true"


CASES = [
    (["rollout.seed=18446744073709551616"], "rollout.seed: is 18446744073709551616; must be an "
     "integer in [0, 2**63 - 1]"),
    (["trainer.seed=9223372036854775808"], "trainer.seed: is 9223372036854775808"),
    (["rollout.top_k=5000"], "rollout.top_k: is 5000, more than the model's vocabulary of 1024"),
    (["model.path=model", "rollout.val_kwargs.top_k=1001"],
     "rollout.val_kwargs.top_k: is 1001, more than the model's vocabulary of 1000 tokens"),
    (["model.path=model", "rollout.prompt_length=1000", "rollout.response_length=100"],
     "prompt_length + response_length = 1100 tokens, beyond the model's context of 1024"),
    (["rollout.response_length=4000", "actor.ppo_max_token_len_per_micro_batch=8192"],
     "beyond the model's context of 2048"),
    # a name that is no directory may be a hub id: looked up in the HF cache (no network here)
    (["model.path=nowhere"], "model.path='nowhere': not a local directory, and as a hub id it is "
     "not in the HF cache"),
    (["model.path=a_file"], "model.path: a_file is a file, not an HF model directory"),
    (["model.path=run_dir_itself"], "not a local directory"),
    (lfs_pointer, "model.safetensors is not a safetensors file"),
    (truncated, "model.safetensors is truncated"),
    (no_tokenizer, "has no tokenizer"),
    (["trainer.output_dir=a_file"], "trainer.output_dir: a_file is a file"),
    (["data.train_batch_size=16"], "data.train_batch_size: is 16, more than the 8 rows"),
    (["trainer.trainer_mode=separate_async", "rollout.checkpoint_engine.backend=nccl"],
     "moves weights over NCCL, which needs CUDA"),
    (["trainer.trainer_mode=separate_async", "rollout.checkpoint_engine.backend=delta",
      "rollout.checkpoint_engine.engine_kwargs.transport=nccl"], "needs CUDA devices"),
    (["rollout.checkpoint_engine.engine_kwargs.bucket_size=1"],
     "rollout.checkpoint_engine.engine_kwargs: auto (naive in-process, else shm, gloo or nccl) "
     "takes no 'bucket_size'"),
    (["trainer.trainer_mode=separate_async", "rollout.checkpoint_engine.backend=delta",
      "rollout.checkpoint_engine.engine_kwargs.shm_dirr=/x"],
     "delta takes no 'shm_dirr'; its options are device, dtype, master_addr, max_sparse_ratio, "
     "shm_dir, transport"),
    (another_model_checkpoint, "checkpoint run/checkpoints/step_3/actor/config.json is of another "
     "model than model.path: hidden_size 256 (model.path: 64)"),
]


@pytest.mark.parametrize("change, words", CASES, ids=[words[:30] for _, words in CASES])
def test_the_cli_reports_it_before_anything_starts(run_dir, change, words):
    overrides = change(run_dir) if callable(change) else change
    overrides = [overrides] if isinstance(overrides, str) else overrides
    code, stderr, heavy = run_cli(["train", "config.yaml", *overrides], run_dir)
    assert (code, heavy) == (2, []), stderr
    assert words in stderr and "Traceback" not in stderr, stderr
    assert len(stderr.strip().splitlines()) == 2


def checked(overrides: list[str]):
    """The loaded config after the preflight's model checks (what tandem train runs)."""
    config = load_config(overrides=overrides)
    check_model(config.model.path)
    check_model_fit(config)
    return config


def test_a_complete_model_directory_and_int64_seeds_pass(run_dir, monkeypatch):
    monkeypatch.chdir(run_dir)
    config = checked(["model.path=model", f"rollout.seed={2**63 - 1}", "rollout.top_k=1000",
                      "rollout.prompt_length=900", "rollout.response_length=124"])
    assert config.rollout.seed == 2**63 - 1
    with pytest.raises(ConfigError, match="rope|context of 1024"):
        checked(["model.path=model", "rollout.prompt_length=1000"])


def test_rope_scaling_extends_the_context(run_dir, monkeypatch):
    monkeypatch.chdir(run_dir)
    config_file = run_dir / "model" / "config.json"
    hf = json.loads(config_file.read_text())
    config_file.write_text(json.dumps({**hf, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}))
    checked(["model.path=model", "rollout.prompt_length=3000", "rollout.response_length=1000",
             "actor.ppo_max_token_len_per_micro_batch=4096"])


@pytest.mark.parametrize("name", sorted(ENGINE_KWARGS))
def test_the_engine_kwargs_table_matches_the_constructors(name):
    """What load time accepts is exactly what each engine's constructor takes."""
    if name in unavailable_checkpoint_engines():  # nccl on a CPU build of torch
        from tandem.weight_sync.collective import CollectiveCheckpointEngine as engine
    else:
        engine = get_checkpoint_engine_class(name)
    parameters = inspect.signature(engine).parameters
    taken = {p for p, spec in parameters.items() if spec.kind is spec.POSITIONAL_OR_KEYWORD}
    internal = {"bucket_megabytes", "timeout_s", "current_weights", "current_version",
                "current_values", "patches_in_place"}  # set by a receiver, not by the config
    assert set(ENGINE_KWARGS[name]) == taken - internal
