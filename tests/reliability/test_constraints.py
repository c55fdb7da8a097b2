"""Issue 28, "nothing pins them": constraints.txt records a version for every dependency (and
every package they pull in) that `make` installs, so a new release cannot silently change what
a fresh machine runs; the installed environment is the recorded one."""

from __future__ import annotations

import re
import tomllib
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# pinned here but installed beside .venv, not into it: verifiers needs openai<3, .venv pins 3
# (`make verifiers` installs it into .verifiers with the other pins); openenv: its gradio wants
# older pillow and huggingface-hub (`make openenv` puts its classes into .openenv)
BESIDE = {"verifiers", "openenv"}


def normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def pins() -> dict[str, str]:
    lines = (ROOT / "constraints.txt").read_text().splitlines()
    pairs = [line.split("==") for line in lines if line and not line.startswith("#")]
    assert all(len(pair) == 2 for pair in pairs), "every line is name==version"
    return {normalized(name): version for name, version in pairs}


def requirement_names(requirements: list[str]) -> set[str]:
    return {normalized(re.split(r"[<>=!~\[; ]", requirement, maxsplit=1)[0])
            for requirement in requirements}


def dev_requirements(project: dict) -> list[str]:
    """The dev extra with the project's own extras it names (tandem-rl[all]) expanded."""
    extras, own = project["optional-dependencies"], normalized(project["name"])
    pending, seen, requirements = ["dev"], set(), []
    while pending:
        extra = pending.pop()
        seen.add(extra)
        for requirement in extras[extra]:
            name, _, rest = requirement.partition("[")
            if normalized(name) == own:
                pending += [e for e in rest.rstrip("]").split(",") if e not in seen]
            else:
                requirements.append(requirement)
    return requirements


def test_every_direct_dependency_is_pinned():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    names = requirement_names(project["dependencies"] + dev_requirements(project))
    missing = names - set(pins())
    assert not missing, f"add {sorted(missing)} to constraints.txt (make constraints)"


def test_the_installed_environment_is_the_recorded_one():
    """What the tests run with here: each pinned package installed at its pinned version
    (torch's local label +cpu aside), except those installed beside .venv."""
    for name, version in pins().items():
        if name in BESIDE:
            continue
        installed = metadata.version(name).split("+")[0]
        assert installed == version, f"{name} {installed} installed, {version} recorded"


def test_the_makefile_installs_with_the_constraints():
    makefile = (ROOT / "Makefile").read_text()
    assert "pip install -q -c constraints.txt -e '.[dev]'" in makefile
    assert "cat pyproject.toml constraints.txt | sha1sum" in makefile  # a new pin reinstalls
