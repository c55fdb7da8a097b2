"""Issue 11, "CLI": a bad config, dataset or resume request fails before torch or Ray is
imported (checked through sys.modules in a fresh interpreter, not by timing), with one message
naming the file/field and no traceback unless --debug, and a nonzero exit status."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

import tandem
from tandem.cli import checked_config
from tandem.config import ConfigError

SRC = str(Path(tandem.__file__).resolve().parents[1])
HEAVY = ("torch", "ray", "transformers")
ROW = {"prompt": [{"role": "user", "content": "1+1?"}], "data_source": "arithmetic",
       "ground_truth": "2"}


def run_cli(args: list[str], cwd: Path) -> tuple[int, str, list[str]]:
    """(exit status, stderr, heavy modules imported) of `tandem ARGS` in a fresh interpreter."""
    code = ("import atexit, json, sys\n"
            f"atexit.register(lambda: print(json.dumps([m for m in {HEAVY!r} if m in sys.modules])))\n"
            f"from tandem.cli import main\nmain({args!r})\n")
    env = {**os.environ, "PYTHONPATH": SRC}
    done = subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=120)
    return done.returncode, done.stderr, json.loads(done.stdout.strip().splitlines()[-1])


def write_rows(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    write_rows(tmp_path / "train.jsonl", [ROW] * 8)
    (tmp_path / "config.yaml").write_text(
        "data:\n  train_files: [train.jsonl]\n  train_batch_size: 8\n"
        "trainer:\n  output_dir: run\n")
    return tmp_path


def bad_rows(tmp_path: Path, kind: str) -> Path:
    path = tmp_path / "bad.jsonl"
    if kind == "no ground_truth":
        write_rows(path, [ROW, {**ROW, "ground_truth": None}])
    elif kind == "unknown data_source":
        write_rows(path, [ROW, ROW, {**ROW, "data_source": "chess"}])
    elif kind == "array line":
        path.write_text(json.dumps(ROW) + "\n" + json.dumps([ROW]) + "\n")
    elif kind == "utf-16":
        path.write_text(json.dumps(ROW) + "\n", encoding="utf-16")
    return path


@pytest.mark.parametrize("kind, words", [
    ("no ground_truth", "bad.jsonl: row 1: no ground_truth"),
    ("unknown data_source", "bad.jsonl: row 2: no reward function for data_source 'chess'"),
    ("array line", "bad.jsonl:2: a JSON list, not an object"),
    ("utf-16", "bad.jsonl: not UTF-8 text (byte 0; it starts with a UTF-16 byte-order mark)"),
])
def test_bad_datasets_are_found_before_anything_starts(run_dir, kind, words, monkeypatch):
    monkeypatch.chdir(run_dir)
    bad_rows(run_dir, kind)
    with pytest.raises(ValueError) as error:
        checked_config(str(run_dir / "config.yaml"), [f"data.val_files=[{run_dir / 'bad.jsonl'}]"],
                       "train")
    assert words in str(error.value) and str(run_dir / "bad.jsonl") in str(error.value)


@pytest.mark.parametrize("args, status, words", [
    (["train", "config.yaml", "actor.optim.grad_clip=0"], 2,
     "tandem train: error: actor.optim.grad_clip: is 0.0; must be > 0"),
    (["train", "config.yaml", "rollout=5"], 2, "tandem train: error: rollout: is 5, but it is a section"),
    (["eval", "missing.yaml"], 2, "config file missing.yaml does not exist"),
    (["train", "config.yaml", "data.train_files=[nowhere.jsonl]"], 2,
     "data.train_files: dataset file 'nowhere.jsonl' does not exist"),
    (["train", "config.yaml", "data.val_files=[bad.jsonl]"], 2,
     "data.val_files: bad.jsonl: row 1: no ground_truth"),
    (["eval", "config.yaml", "trainer.resume=true"], 2,
     "trainer.resume=true but run/checkpoints holds no checkpoint"),
    (["train", "config.yaml", "trainer.resume=true", "trainer.resume_missing=fail"], 2,
     "trainer.resume_missing=warn"),
])
def test_cli_errors_are_one_message_before_torch_or_ray(run_dir, args, status, words):
    bad_rows(run_dir, "no ground_truth")
    code, stderr, heavy = run_cli(args, run_dir)
    assert (code, heavy) == (status, [])
    assert words in stderr and "Traceback" not in stderr
    assert stderr.strip().splitlines()[-1] == "(run with --debug to see the traceback)"
    assert len(stderr.strip().splitlines()) == 2


def test_debug_shows_the_traceback(run_dir):
    for args in (["--debug", "train", "config.yaml", "rollout=5"],
                 ["train", "--debug", "config.yaml", "rollout=5"]):
        code, stderr, _ = run_cli(args, run_dir)
        assert code != 0 and "Traceback" in stderr and "rollout: is 5" in stderr


def test_a_good_config_passes_the_checks_without_torch(run_dir):
    code = ("import sys\nfrom tandem.cli import checked_config\n"
            "config = checked_config('config.yaml', [], 'train')\n"
            f"print([m for m in {HEAVY!r} if m in sys.modules], config.data.train_batch_size)\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=run_dir, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": SRC}, timeout=120)
    assert done.stdout.strip() == "[] 8", done.stderr


def test_train_resume_without_a_checkpoint_warns_by_default(run_dir, monkeypatch, caplog):
    monkeypatch.chdir(run_dir)
    with caplog.at_level(logging.WARNING, logger="tandem"):
        config = checked_config("config.yaml", ["trainer.resume=true"], "train")
    assert config.trainer.resume
    assert "trainer.resume=true but run/checkpoints holds no checkpoint" in caplog.text
    assert "starting from step 0" in caplog.text


def test_resume_with_a_checkpoint_passes(run_dir, monkeypatch):
    monkeypatch.chdir(run_dir)
    (run_dir / "run" / "checkpoints").mkdir(parents=True)
    (run_dir / "run" / "checkpoints" / "latest").write_text("3")
    for command in ("train", "eval"):
        checked_config("config.yaml", ["trainer.resume=true", "trainer.resume_missing=fail"], command)
    with pytest.raises(ConfigError):
        checked_config("config.yaml", ["trainer.resume=true", "trainer.output_dir=elsewhere"], "eval")
