"""Typed configuration: dataclasses (schema.py), YAML + overrides and validation (load.py)."""

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
