"""bench/gpu_check.sh on a CPU box: its dry run writes the whole plan to one file, and a live
run without a GPU stops at once with a clear message instead of installing anything."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "gpu_check.sh"


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True,
                          timeout=60)


def test_dry_run_writes_every_step_to_one_file(tmp_path):
    out = tmp_path / "results.md"
    done = run("--dry-run", "--out", str(out))
    assert done.returncode == 0, done.stderr
    text = out.read_text()
    assert "DRY RUN" in text.splitlines()[2]
    steps = re.findall(r"^## (.+)$", text, flags=re.M)
    assert steps == ["device", "install: tandem (.venv-gpu)", "install: vllm (.venv-gpu-vllm)",
                     "install: sglang (.venv-gpu-sglang)",
                     "gpu-marked tests (native CUDA, NCCL / CUDA IPC sync)",
                     "conformance: native on CUDA", "conformance: vllm on CUDA",
                     "conformance: sglang on CUDA", "bench: native vs vLLM vs HF, 0.5B shape, bf16"]
    assert "pytest -q -m gpu tests" in text
    assert ("bench/engine.py --engines native,hf,vllm --models 0.5b --device cuda "
            "--dtype bfloat16") in text
    assert text.count("(dry run: not executed") == len(steps)
    # the steps' limits add up to under 10 minutes once installed
    limits = [int(n) for n in re.findall(r"limit (\d+) s", text)]
    assert sum(limits[4:]) <= 600 and "0 step(s) failed" in text


def test_skip_install_drops_the_install_steps(tmp_path):
    out = tmp_path / "results.md"
    assert run("--dry-run", "--skip-install", "--out", str(out)).returncode == 0
    assert "install:" not in out.read_text()


def test_bad_argument_is_refused():
    done = run("--fast")
    assert done.returncode == 2 and "unknown argument --fast" in done.stderr


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="this machine has a GPU")
def test_live_run_without_a_gpu_stops_before_installing(tmp_path):
    out = tmp_path / "results.md"
    done = run("--out", str(out))
    assert done.returncode == 2 and "no NVIDIA GPU" in done.stderr
    assert "## " not in out.read_text()  # no step ran
