"""Validated run configuration: `load_config(overrides)` composes configs/agent_ppo_trainer.yaml with
Hydra overrides and returns an `AgentRLConfig`, or raises one `ConfigError` listing every problem."""

from agentrl.config.errors import ConfigError
from agentrl.config.loading import (
    config_dir,
    config_to_dict,
    config_to_yaml,
    load_config,
    save_resolved_config,
    validate_config,
)
from agentrl.config.schema import (
    AgentConfig,
    AgentRLConfig,
    AlgorithmConfig,
    DataConfig,
    SFTConfig,
    TrainerConfig,
)
from agentrl.config.schema_workers import (
    ActorConfig,
    ActorRolloutRefConfig,
    CriticConfig,
    ModelConfig,
    OptimConfig,
    RolloutConfig,
)

__all__ = [
    "ActorConfig",
    "ActorRolloutRefConfig",
    "AgentConfig",
    "AgentRLConfig",
    "AlgorithmConfig",
    "CriticConfig",
    "DataConfig",
    "ModelConfig",
    "OptimConfig",
    "RolloutConfig",
    "SFTConfig",
    "TrainerConfig",
    "ConfigError",
    "config_dir",
    "config_to_dict",
    "config_to_yaml",
    "load_config",
    "save_resolved_config",
    "validate_config",
]
