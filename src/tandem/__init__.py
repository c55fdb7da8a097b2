"""tandem: the rollout side of RL post-training for language models.

The public API (docs/api.md); each name is imported on first use, so `import tandem` stays
light (no torch, no Ray) and the CLI can check a config before either starts.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.2.0"

# public name -> the module that owns it
_EXPORTS = {
    "load_config": "tandem.config.load",
    "ConfigError": "tandem.config.load",
    "TandemConfig": "tandem.config.schema",
    "Trainer": "tandem.job",
    "Tool": "tandem.tools.registry",
    "ToolResult": "tandem.tools.registry",
    "RewardResult": "tandem.rewards.registry",
    "register_reward": "tandem.rewards.registry",
    "TokenOutput": "tandem.types",
}
__all__ = ["__version__", *_EXPORTS]

if TYPE_CHECKING:
    from tandem.config.load import ConfigError, load_config
    from tandem.config.schema import TandemConfig
    from tandem.job import Trainer
    from tandem.rewards.registry import RewardResult, register_reward
    from tandem.tools.registry import Tool, ToolResult
    from tandem.types import TokenOutput


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'tandem' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)


def __dir__() -> list[str]:
    return sorted(__all__)
