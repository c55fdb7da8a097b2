"""Typed configuration: dataclasses (schema.py), YAML + overrides (load.py) and the field checks
beside them, by concern (*_check.py, ranges.py, choices.py, footprint.py)."""

from tandem.config.load import ConfigError, load_config, to_yaml
from tandem.config.schema import (
    ActorConfig,
    AlgorithmConfig,
    CheckpointEngineConfig,
    CriticConfig,
    DataConfig,
    ModelConfig,
    RefConfig,
    RewardConfig,
    RolloutConfig,
    TandemConfig,
    TrainerConfig,
)

__all__ = [
    "ActorConfig", "AlgorithmConfig", "CheckpointEngineConfig", "ConfigError", "CriticConfig",
    "DataConfig", "ModelConfig", "RefConfig", "RewardConfig", "RolloutConfig", "TandemConfig",
    "TrainerConfig", "load_config", "to_yaml",
]
