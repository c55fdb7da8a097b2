"""Load the user's own objects (reward functions, tool classes) named in a config entry:
`path/to/file.py:Name` (a file, relative to the working directory) or `package.module:Name`.
Every error names the config field and the entry."""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
from pathlib import Path
from typing import Any


class UserCodeError(ValueError):
    """A config entry does not name a loadable object; the message names the field and the entry."""


def split_entry(entry: str, field: str) -> tuple[str, str]:
    """("file.py" or "package.module", "Name") of an entry "where:Name"."""
    where, sep, name = entry.rpartition(":")
    if not sep or not where or not name.isidentifier():
        raise UserCodeError(f"{field}: {entry!r} is not of the form 'path/to/file.py:Name' or "
                            "'package.module:Name'")
    return where, name


def load_module(where: str, field: str, entry: str) -> Any:
    """The module of a file path (ends in .py) or a dotted module name."""
    if not where.endswith(".py"):
        try:
            return importlib.import_module(where)
        except ImportError as error:
            raise UserCodeError(f"{field}: {entry!r}: cannot import module {where!r} ({error}); "
                                "check the name and that it is on PYTHONPATH (or give a .py file "
                                "path)") from None
    path = Path(where).expanduser().resolve()
    if not path.is_file():
        raise UserCodeError(f"{field}: {entry!r}: no file {path}; give the path of a .py file "
                            "(relative to the working directory) or a module name")
    # one module per file, keyed by its path, so a second lookup reuses the first import
    name = f"tandem_user_{path.stem}_{hashlib.sha1(str(path).encode()).hexdigest()[:8]}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as error:
        del sys.modules[name]
        raise UserCodeError(f"{field}: {entry!r}: importing {path} raised "
                            f"{type(error).__name__}: {error}") from error
    return module


def load_object(entry: str, field: str) -> Any:
    """The object an entry names, e.g. load_object("rewards.py:compute_score", "reward.custom_function")."""
    where, name = split_entry(entry, field)
    module = load_module(where, field, entry)
    if not hasattr(module, name):
        public = sorted(n for n in vars(module) if not n.startswith("_"))
        raise UserCodeError(f"{field}: {entry!r}: {where} defines no {name!r} (it defines "
                            f"{', '.join(public) or 'nothing public'})")
    return getattr(module, name)
