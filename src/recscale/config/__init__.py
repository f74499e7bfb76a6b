"""Typed configuration: one dataclass per component, composed by :class:`Config`."""

from recscale.config.errors import ConfigError
from recscale.config.loader import config_to_toml, load_config, preset_names
from recscale.config.schema import (
    CheckpointConfig,
    Config,
    DataConfig,
    DenseOptimizerConfig,
    DistributedConfig,
    EmbeddingConfig,
    ModelConfig,
    TrainConfig,
)

__all__ = [
    "CheckpointConfig",
    "DistributedConfig",
    "Config",
    "ConfigError",
    "DataConfig",
    "DenseOptimizerConfig",
    "EmbeddingConfig",
    "ModelConfig",
    "TrainConfig",
    "config_to_toml",
    "load_config",
    "preset_names",
]
