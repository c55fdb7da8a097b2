"""The install command of an optional feature, for error hints: the extra's own requirements
read from the installed distribution's metadata (tandem-rl is installed from a checkout or a
built wheel, not from a package index, where a command naming its extras would not resolve)."""

from __future__ import annotations

import importlib.metadata
import re

DISTRIBUTION = "tandem-rl"


def install_command(extra: str, fallback: str) -> str:
    """`pip install '<req>' ...` for the extra's requirements, or `pip install fallback` when the
    metadata is unavailable (a source tree on sys.path without an install)."""
    try:
        requires = importlib.metadata.requires(DISTRIBUTION) or []
    except importlib.metadata.PackageNotFoundError:
        requires = []
    marker = re.compile(r"""^(?P<req>[^;]+);\s*extra\s*==\s*["']""" + re.escape(extra) + "[\"']$")
    wanted = [match["req"].strip() for match in map(marker.match, requires) if match]
    wanted = [req for req in wanted if not req.startswith(DISTRIBUTION)] or [fallback]
    return "pip install " + " ".join(f"'{req}'" for req in wanted)
