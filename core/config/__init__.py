"""dualrl configuration: plain dicts typed by ``TypedDict``s, one generic validator.

Code reads configs as dicts (``config["policy"]["backend"]``, the NeMo RL idiom); the
schemas in :mod:`core.config.schema` describe them and :mod:`core.config.validate`
checks them, reporting every problem at once in a :class:`ConfigError` whose lines each
start with the dotted path of the field.  :mod:`core.config.loader` reads YAML files
(with ``defaults:`` inheritance) and applies ``a.b=value`` overrides.

Importing this package needs neither torch, jax, ray nor (until a file is loaded) PyYAML.
"""

from core.config.loader import (
    DEFAULT_CONFIG_PATH,
    EMBEDDED_CONFIGS,
    apply_overrides,
    deep_merge,
    load_config,
    load_yaml,
    parse_override,
)
from core.config.schema import (
    BACKENDS,
    GENERATION_BACKENDS,
    PRECISIONS,
    ArithmeticTaskConfig,
    Backend,
    CheckpointingConfig,
    ClippedPGLossConfig,
    ClusterConfig,
    ColocationConfig,
    ColocationResources,
    DataConfig,
    DPOConfig,
    DPOLossConfig,
    DTensorConfig,
    DynamicBatchingConfig,
    EnvConfig,
    GenerationConfig,
    GRPOConfig,
    JaxConfig,
    LoggerConfig,
    MasterConfig,
    MathEnvConfig,
    OptimizerConfig,
    PolicyConfig,
    Precision,
    SchedulerConfig,
    SchedulerMilestones,
    SequencePackingConfig,
    SFTConfig,
    TokenizerConfig,
    VllmConfig,
)
from core.config.validate import (
    ConfigError,
    check_section,
    validate_loss_config,
    validate_master_config,
    validate_policy_config,
    validate_typed,
)

__all__ = [
    # errors & validation
    "ConfigError",
    "validate_typed",
    "check_section",
    "validate_policy_config",
    "validate_loss_config",
    "validate_master_config",
    # loading
    "DEFAULT_CONFIG_PATH",
    "EMBEDDED_CONFIGS",
    "load_yaml",
    "deep_merge",
    "parse_override",
    "apply_overrides",
    "load_config",
    # constants
    "BACKENDS",
    "PRECISIONS",
    "GENERATION_BACKENDS",
    "Backend",
    "Precision",
    # schemas
    "TokenizerConfig",
    "DTensorConfig",
    "JaxConfig",
    "DynamicBatchingConfig",
    "SequencePackingConfig",
    "OptimizerConfig",
    "SchedulerConfig",
    "SchedulerMilestones",
    "VllmConfig",
    "ColocationResources",
    "ColocationConfig",
    "GenerationConfig",
    "PolicyConfig",
    "ClusterConfig",
    "ClippedPGLossConfig",
    "DPOLossConfig",
    "GRPOConfig",
    "SFTConfig",
    "DPOConfig",
    "DataConfig",
    "ArithmeticTaskConfig",
    "MathEnvConfig",
    "EnvConfig",
    "LoggerConfig",
    "CheckpointingConfig",
    "MasterConfig",
]
