"""The acceptance run of a new user: in a copy of the checkout, the README's install block run
as written (a venv, the CPU torch wheel from PyTorch's index, `pip install '.[plots]'`, which builds
the wheel and installs it with its declared dependencies, no checkout on sys.path), then
examples/byoj twice: the Python script (its own verl-style reward, Tool class and JSONL data
through tandem.Trainer) and `tandem train job.yaml` naming the same reward and tool only in YAML."""

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]


def run(args, cwd, timeout=1200, env=None):
    result = subprocess.run([str(a) for a in args], cwd=cwd, capture_output=True, text=True,
                            timeout=timeout, env=env)
    assert result.returncode == 0, f"{args}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result


def readme_install_block() -> str:
    """The README's first bash block under "Install from a checkout", exactly as a user copies it."""
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("Install from a checkout"):]
    return re.search(r"```bash\n(.*?)```", section, re.S)[1]


def checkout_copy(target: Path) -> Path:
    """The files a fresh clone of this tree has (tracked and not ignored), nothing built."""
    listed = run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], ROOT).stdout
    for name in filter(None, listed.split("\0")):
        if (ROOT / name).is_file():
            (target / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, target / name)
    return target


def test_the_readme_install_block_is_the_one_this_test_runs():
    block = readme_install_block()
    assert "pip install torch --index-url https://download.pytorch.org/whl/cpu" in block
    assert "pip install '.[plots]'" in block and "python3 -m venv .venv" in block


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_a_fresh_venv_from_the_readme_install_runs_the_users_job(tmp_path):
    checkout = checkout_copy(tmp_path / "checkout")
    env = {key: value for key, value in os.environ.items()
           if key not in ("PYTHONPATH", "RAY_ADDRESS", "VIRTUAL_ENV")}
    run(["bash", "-euc", readme_install_block()], checkout, timeout=2400, env=env)
    venv = checkout / ".venv"
    python = venv / "bin" / "python"
    assert "+cpu" in run([python, "-c", "import torch; print(torch.__version__)"], tmp_path).stdout

    job = tmp_path / "job"
    shutil.copytree(ROOT / "examples" / "byoj", job)
    # as a new user: no checkout on the path, Ray started by tandem (a cluster of its own)
    where = run([python, "-c", "import tandem, sys; print(tandem.__file__); print(sys.path)"], job,
                env=env).stdout
    assert str(venv) in where.splitlines()[0]
    assert str(ROOT / "src") not in where and str(checkout / "src") not in where

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
