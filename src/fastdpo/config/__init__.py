"""The configuration floor. A training run's flags come in sections, one concern per file (`sections/`: model,
LoRA, data, batching, optimizer, loss, reference, evaluation, output, hub, run, profiling, monitoring, parallel),
joined flat in `TrainConfig` (`train`); what set-up resolves from them is the run's `RunPlan` (`plan`). Also: the
parallel plan the flags ask for (`parallel`), other tools' flags (`compat`), and the command-line / YAML mapping
(`flags`). Everything above imports its config from here."""

from fastdpo.config.fields import Section, check_choice, option, parse_bool, parse_dict
from fastdpo.config.flags import ADAPTER_FLAGS, Parser, add_config_flags, build_config, load_yaml, save_config
from fastdpo.config.parallel import DEEPSPEED_ALIASES, FSDP_MODES, LESS_MEMORY, Plan, parallel_plan
from fastdpo.config.plan import RunPlan
from fastdpo.config.sections import (
    ATTN_IMPLS,
    CHECKPOINT_POLICIES,
    DTYPES,
    F_DIVERGENCE_TYPES,
    LR_SCHEDULERS,
    PAIR_METRICS,
    REPORT_TARGETS,
    BatchingSection,
    DataReading,
    DataSection,
    EvaluationSection,
    GenerationArgs,
    HubSection,
    LoraSection,
    LossSection,
    ModelArgs,
    ModelSection,
    MonitoringSection,
    OptimizerSection,
    OutputSection,
    ParallelSection,
    ProfilingSection,
    ReferenceSection,
    RunSection,
    check_installed,
    check_metric_name,
    check_push,
    checkpoint_policy,
    parse_steps,
    report_targets,
    require_matplotlib,
)
from fastdpo.config.train import TRAIN_SECTIONS, TrainConfig

__all__ = [
    "ADAPTER_FLAGS", "ATTN_IMPLS", "BatchingSection", "CHECKPOINT_POLICIES", "DEEPSPEED_ALIASES", "DTYPES",
    "DataReading", "DataSection", "EvaluationSection", "FSDP_MODES", "F_DIVERGENCE_TYPES", "GenerationArgs",
    "HubSection", "LESS_MEMORY", "LR_SCHEDULERS", "LoraSection", "LossSection", "ModelArgs", "ModelSection",
    "MonitoringSection", "OptimizerSection", "OutputSection", "PAIR_METRICS", "ParallelSection", "Parser", "Plan",
    "ProfilingSection", "REPORT_TARGETS", "ReferenceSection", "RunPlan", "RunSection", "Section", "TRAIN_SECTIONS",
    "TrainConfig", "add_config_flags", "build_config", "check_choice", "check_installed", "check_metric_name",
    "check_push", "checkpoint_policy", "load_yaml", "option", "parallel_plan", "parse_bool", "parse_dict",
    "parse_steps", "report_targets", "require_matplotlib", "save_config",
]
