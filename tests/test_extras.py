"""Install hints name what installs: an extra's own requirements from the installed metadata,
never `pip install 'tandem-rl[...]'` (tandem-rl is installed from a checkout or a built wheel)."""

import re
import tomllib
from pathlib import Path

import pytest

from tandem.config.choices import ConfigError
from tandem.config.load import load_config
from tandem.extras import install_command

ROOT = Path(__file__).resolve().parents[1]


def test_an_extras_install_command_lists_its_requirements_from_pyproject():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for extra in ("wandb", "mlflow", "tensorboard", "plots", "datasets", "serving"):
        assert install_command(extra, "x") == "pip install " + " ".join(
            f"'{requirement}'" for requirement in extras[extra])
    assert install_command("no-such-extra", "somepackage") == "pip install 'somepackage'"


def test_no_hint_in_the_package_names_a_distribution_that_does_not_install():
    pattern = re.compile(r"pip install [^\n]*tandem(-rl)?\[")
    offenders = [str(path.relative_to(ROOT)) for path in (ROOT / "src" / "tandem").rglob("*.py")
                 if pattern.search(path.read_text())]
    assert offenders == []


def test_a_logger_without_its_package_names_the_install(monkeypatch):
    import importlib.util

    from tandem.preflight import check_names

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(ConfigError, match=r"trainer\.loggers: .*pip install 'wandb>=0\.21' or drop"):
        check_names(load_config(overrides=["trainer.loggers=[console,wandb]"]), None)
