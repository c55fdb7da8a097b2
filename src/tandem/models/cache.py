"""Where built and converted models live: $TANDEM_CACHE or ~/.cache/tandem."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable


def cache_dir() -> Path:
    """The root of tandem's model cache."""
    root = Path(os.environ.get("TANDEM_CACHE", Path.home() / ".cache" / "tandem"))
    root.mkdir(parents=True, exist_ok=True)
    return root


def build_once(name: str, build: Callable[[Path], None]) -> Path:
    """Return cache_dir()/name, calling build(tmpdir) first if it is missing; atomic on success."""
    target = cache_dir() / name
    if (target / ".complete").exists():
        return target
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=cache_dir()))
    try:
        build(tmp)
        (tmp / ".complete").touch()
        try:
            os.replace(tmp, target)
        except OSError:  # another process finished first
            if not (target / ".complete").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target
