"""The layer order of docs/architecture.md, kept by import-linter's contracts in pyproject.toml:
no module imports from a layer above its own, no import cycle between tandem's packages."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")


def lint_imports(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(LINT_IMPORTS), "--no-cache", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)


def test_the_import_contracts_hold():
    done = lint_imports()
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "2 kept, 0 broken" in done.stdout


def test_an_upward_import_breaks_the_layers_contract(tmp_path):
    """The checker sees the real imports: with weight_sync put above serving, the server's
    import of the transports it receives through is reported."""
    config = tmp_path / "contracts.toml"
    config.write_text('[tool.importlinter]\nroot_package = "tandem"\n\n'
                      '[[tool.importlinter.contracts]]\nname = "inverted"\ntype = "layers"\n'
                      'layers = ["tandem.weight_sync", "tandem.serving"]\n')
    done = lint_imports("--config", str(config))
    assert done.returncode != 0
    assert "tandem.serving.server -> tandem.weight_sync" in done.stdout
