"""Models by hub id from a local HF cache, offline (no network to the hub here)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tandem.models.tiny import build_tiny_model

REPO = "tandem-test/tiny-chat"
REVISION = "0123456789abcdef0123456789abcdef01234567"


def hub_cache(root: Path) -> Path:
    """An HF hub cache (HF_HUB_CACHE layout) holding the tiny model as REPO at REVISION."""
    repo = root / f"models--{REPO.replace('/', '--')}"
    snapshot = repo / "snapshots" / REVISION
    snapshot.mkdir(parents=True)
    for source in build_tiny_model().iterdir():
        if source.is_file() and not source.name.startswith("."):
            (snapshot / source.name).write_bytes(source.read_bytes())
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(REVISION)
    return root


def run_offline(cache: Path, code: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1",
           "HF_HOME": str(cache.parent / "hf_home")}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                          timeout=240)


def test_a_hub_id_loads_from_the_offline_cache(tmp_path):
    cache = hub_cache(tmp_path / "hub")
    code = (f"from tandem.models.tiny import resolve_model_path\n"
            f"from tandem.preflight.model_files import hf_config\n"
            f"from tandem.preflight import check_model\n"
            f"from transformers import AutoModelForCausalLM, AutoTokenizer\n"
            f"path = resolve_model_path({REPO!r})\n"
            f"assert check_model({REPO!r}) == path\n"
            f"model = AutoModelForCausalLM.from_pretrained({REPO!r})\n"
            f"tokenizer = AutoTokenizer.from_pretrained(path)\n"
            f"print(path.name, hf_config({REPO!r})['hidden_size'], model.config.hidden_size, "
            f"tokenizer.eos_token)\n")
    result = run_offline(cache, code)
    assert result.returncode == 0, result.stderr
    hidden = json.loads((build_tiny_model() / "config.json").read_text())["hidden_size"]
    assert result.stdout.split() == [REVISION, str(hidden), str(hidden), "<|im_end|>"]


def test_a_hub_id_missing_offline_is_one_config_error_naming_the_fix(tmp_path):
    cache = tmp_path / "empty"
    cache.mkdir()
    code = ("from tandem.preflight import check_model\n"
            "from tandem.config.load import ConfigError\n"
            "try:\n    check_model('nobody/nothing')\n"
            "except ConfigError as error:\n    print(error)\n")
    result = run_offline(cache, code)
    assert result.returncode == 0, result.stderr
    assert "model.path='nobody/nothing': not a local directory" in result.stdout
    assert "HF_HUB_OFFLINE=1 reads only the cache" in result.stdout


@pytest.mark.parametrize("path", ["./no/such/dir", "/tmp"])
def test_a_path_that_is_not_a_model_is_refused(path):
    from tandem.config.load import ConfigError
    from tandem.preflight import check_model

    with pytest.raises(ConfigError, match="is not an HF model directory"):
        check_model(path)
