"""The acceptance run of a new user: build the wheel, install it with only its declared
dependencies into a fresh venv (no checkout on sys.path), then run examples/byoj twice: the
Python script (its own verl-style reward, Tool class and JSONL data through tandem.Trainer) and
`tandem train job.yaml` naming the same reward and tool only in YAML."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
TORCH = "torch==2.13.0"  # the Makefile's pin: the local CPU wheel (a bare range pulls CUDA builds)


def run(args, cwd, timeout=1200, env=None):
    result = subprocess.run([str(a) for a in args], cwd=cwd, capture_output=True, text=True,
                            timeout=timeout, env=env)
    assert result.returncode == 0, f"{args}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_a_fresh_venv_with_the_wheel_runs_the_users_job(tmp_path):
    wheels = tmp_path / "wheels"
    run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", wheels, ROOT], ROOT)
    (wheel,) = wheels.glob("tandem_rl-*.whl")
    venv = tmp_path / "venv"
    run([sys.executable, "-m", "venv", venv], tmp_path)
    python = venv / "bin" / "python"
    run([python, "-m", "pip", "install", "-q", TORCH], tmp_path)
    run([python, "-m", "pip", "install", "-q", wheel], tmp_path)

    job = tmp_path / "job"
    shutil.copytree(ROOT / "examples" / "byoj", job)
    # as a new user: no checkout on the path, Ray started by tandem (a cluster of its own)
    env = {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "RAY_ADDRESS")}
    where = run([python, "-c", "import tandem, sys; print(tandem.__file__); print(sys.path)"], job,
                env=env).stdout
    assert str(venv) in where.splitlines()[0] and str(ROOT / "src") not in where

    script = run([python, "train.py"], job, env=env).stdout
    calls = next(line for line in script.splitlines() if line.startswith("tool calls"))
    assert int(calls.split()[2]) > 0, script
    assert "model runs/python/checkpoints/step_2/actor" in script  # trainer.output_dir is relative
    model = job / "runs" / "python" / "checkpoints" / "step_2" / "actor"
    load = ("from transformers import AutoModelForCausalLM, AutoTokenizer\n"
            f"AutoModelForCausalLM.from_pretrained({str(model)!r})\n"
            f"print(AutoTokenizer.from_pretrained({str(model)!r}).eos_token)")
    assert run([python, "-c", load], job, env=env).stdout.strip() == "<|im_end|>"

    cli = run([venv / "bin" / "tandem", "train", "job.yaml"], job, env=env)
    records = [json.loads(line) for line in
               (job / "runs" / "cli" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "time/generate" in r]
    assert [r["step"] for r in steps] == [1, 2], cli.stderr[-2000:]
    # my_reward.py's dict gives `acc`; my_tools.py's tool was called in some sample
    assert all("reward/acc" in r for r in steps)
    assert max(r.get("reward/tool_use", 0) for r in records) > 0
    assert (job / "runs" / "cli" / "checkpoints" / "step_2" / "actor" / "model.safetensors").is_file()
    assert "Started a local Ray instance" not in cli.stdout + cli.stderr  # Ray's INFO line
