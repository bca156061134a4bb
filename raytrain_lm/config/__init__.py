"""One typed config tree for a run, loaded from YAML plus dotted overrides.

Components receive only their own section (`build_model(cfg.model)`, `prepare(cfg.data)`,
`BatchPlan.derive(cfg.training)`, `ensure_ray(cfg.scaling)`, ...); only the orchestrators that
wire them together (the driver in trainer/driver/launch.py, the worker loop, the sweep driver) hold
the whole tree. The defaults below *are* the embedded demo: `raytrain-lm train` with no
arguments trains on them.
"""

from raytrain_lm.config.base import (
    RUN_NAME_PATTERN,
    STORAGE_SCHEMES,
    check_storage_location,
)
from raytrain_lm.config.budget import BudgetConfig
from raytrain_lm.config.data import DataConfig, TokenizerConfig
from raytrain_lm.config.fault import CheckpointConfig, FaultConfig
from raytrain_lm.config.loading import (
    closest_key_hint,
    fix_yaml_floats,
    flatten,
    format_validation_error,
    load_config,
    parse_override,
    read_written_config,
    read_yaml_file,
    set_dotted,
    to_yaml,
)
from raytrain_lm.config.model import MODEL_PRESETS, ModelConfig
from raytrain_lm.config.replicas import DilocoConfig, ReplicasConfig
from raytrain_lm.config.run import BALANCE_AUTO_UNDER_FSDP, RunConfig
from raytrain_lm.config.scaling import ScalingConfig
from raytrain_lm.config.tracking import DEFAULT_TRACKING_DB, TRACKING_URI_ENV, TrackingConfig
from raytrain_lm.config.training import OptimConfig, ParallelConfig, TrainingConfig

__all__ = [
    "BALANCE_AUTO_UNDER_FSDP",
    "DEFAULT_TRACKING_DB",
    "MODEL_PRESETS",
    "RUN_NAME_PATTERN",
    "STORAGE_SCHEMES",
    "TRACKING_URI_ENV",
    "BudgetConfig",
    "CheckpointConfig",
    "DataConfig",
    "DilocoConfig",
    "FaultConfig",
    "ModelConfig",
    "OptimConfig",
    "ParallelConfig",
    "ReplicasConfig",
    "RunConfig",
    "ScalingConfig",
    "TokenizerConfig",
    "TrackingConfig",
    "TrainingConfig",
    "check_storage_location",
    "closest_key_hint",
    "fix_yaml_floats",
    "flatten",
    "format_validation_error",
    "load_config",
    "parse_override",
    "read_written_config",
    "read_yaml_file",
    "set_dotted",
    "to_yaml",
]
