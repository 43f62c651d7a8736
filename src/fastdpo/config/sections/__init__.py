"""The config sections, one concern per file: a training run is all of those below `generation` (`TrainConfig`);
`fastdpo infer`, `eval` and `export` take the ones they need (`fastdpo.config.tools`)."""

from fastdpo.config.sections.batching import ATTN_IMPLS, CHECKPOINT_POLICIES, KERNELS, BatchingSection, checkpoint_policy
from fastdpo.config.sections.data import DataReading, DataSection
from fastdpo.config.sections.evaluation import PAIR_METRICS, EvaluationSection, check_metric_name
from fastdpo.config.sections.generation import GenerationArgs, ModelArgs, base_of_adapter
from fastdpo.config.sections.loss import F_DIVERGENCE_TYPES, LossSection, registered_losses
from fastdpo.config.sections.model import DTYPES, LoraSection, ModelSection
from fastdpo.config.sections.monitoring import (
    REPORT_TARGETS,
    MonitoringSection,
    check_installed,
    report_targets,
    require_matplotlib,
)
from fastdpo.config.sections.optimizer import LR_SCHEDULERS, OptimizerSection
from fastdpo.config.sections.output import HubSection, OutputSection, check_push
from fastdpo.config.sections.parallel import ParallelSection
from fastdpo.config.sections.profiling import ProfilingSection, parse_steps
from fastdpo.config.sections.reference import ReferenceSection
from fastdpo.config.sections.run import RunSection

__all__ = [
    "ATTN_IMPLS", "BatchingSection", "CHECKPOINT_POLICIES", "DTYPES", "DataReading", "DataSection",
    "EvaluationSection", "F_DIVERGENCE_TYPES", "GenerationArgs", "HubSection", "KERNELS", "LR_SCHEDULERS",
    "LoraSection", "LossSection", "ModelArgs", "ModelSection", "MonitoringSection", "OptimizerSection",
    "OutputSection", "PAIR_METRICS", "ParallelSection", "ProfilingSection", "REPORT_TARGETS", "ReferenceSection",
    "RunSection", "base_of_adapter", "check_installed", "check_metric_name", "check_push", "checkpoint_policy",
    "parse_steps", "registered_losses", "report_targets", "require_matplotlib",
]
