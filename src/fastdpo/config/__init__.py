"""The configuration floor: the config dataclasses and their validation (`schema`), the parallel plan the flags ask
for (`parallel`), other tools' flags (`compat`), and the command-line / YAML mapping (`flags`). Everything above
imports its config from here."""

from fastdpo.config.flags import ADAPTER_FLAGS, add_config_flags, build_config, load_yaml, save_config
from fastdpo.config.parallel import DEEPSPEED_ALIASES, FSDP_MODES, LESS_MEMORY, Plan, parallel_plan
from fastdpo.config.schema import (
    ATTN_IMPLS,
    CHECKPOINT_POLICIES,
    DTYPES,
    F_DIVERGENCE_TYPES,
    LR_SCHEDULERS,
    PAIR_METRICS,
    REPORT_TARGETS,
    DataReading,
    ModelSection,
    TrainConfig,
    check_installed,
    check_metric_name,
    checkpoint_policy,
    parse_steps,
    report_targets,
    require_matplotlib,
)

__all__ = [
    "ADAPTER_FLAGS", "ATTN_IMPLS", "CHECKPOINT_POLICIES", "DEEPSPEED_ALIASES", "DTYPES", "DataReading",
    "FSDP_MODES", "F_DIVERGENCE_TYPES", "LESS_MEMORY", "LR_SCHEDULERS", "ModelSection", "PAIR_METRICS", "Plan",
    "REPORT_TARGETS", "TrainConfig", "add_config_flags", "build_config", "check_installed", "check_metric_name",
    "checkpoint_policy", "load_yaml", "parallel_plan", "parse_steps", "report_targets", "require_matplotlib",
    "save_config",
]
