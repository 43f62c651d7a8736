"""`TrainConfig`: a training run's flags, section by section (`fastdpo.config.sections`), joined flat.

Every flag keeps its one name (`--beta`, `cfg.beta`, `beta:` in YAML), so the config is written flat, on the command
line, in a YAML file (flat, or nested by section: `loss: {beta: 0.1}`) or in Python (`TrainConfig(model=...,
beta=0.1)`). Each section validates its own flags; this class checks what crosses sections. A function that reads
one concern takes that section's type (`def build_optimizer(params, opt: OptimizerSection)`), and a TrainConfig is
every section at once. What set-up resolves from the config (the checkpointing policy `fit` chose, the token budget)
is not written back here: it lives on the run's `RunPlan` (`fastdpo.config.plan`).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

from fastdpo.config.fields import Section
from fastdpo.config.parallel import parallel_plan
from fastdpo.config.sections.batching import BatchingSection
from fastdpo.config.sections.data import DataSection
from fastdpo.config.sections.evaluation import EvaluationSection
from fastdpo.config.sections.loss import LossSection
from fastdpo.config.sections.model import LoraSection, ModelSection
from fastdpo.config.sections.monitoring import MonitoringSection
from fastdpo.config.sections.optimizer import FULL_LEARNING_RATE, LORA_LEARNING_RATE, OptimizerSection
from fastdpo.config.sections.output import HubSection, OutputSection
from fastdpo.config.sections.parallel import ParallelSection
from fastdpo.config.sections.profiling import ProfilingSection
from fastdpo.config.sections.reference import ReferenceSection
from fastdpo.config.sections.run import RunSection
from fastdpo.errors import FastDPOError

log = logging.getLogger("fastdpo")

# the sections of a training run, in the order --help and the CLI reference list them
TRAIN_SECTIONS: tuple[type[Section], ...] = (
    ModelSection, LoraSection, DataSection, BatchingSection, OptimizerSection, LossSection, ReferenceSection,
    EvaluationSection, OutputSection, HubSection, RunSection, ProfilingSection, MonitoringSection, ParallelSection)


@dataclass
class TrainConfig(ParallelSection, MonitoringSection, ProfilingSection, RunSection, HubSection, OutputSection,
                  EvaluationSection, ReferenceSection, LossSection, OptimizerSection, BatchingSection, DataSection,
                  LoraSection, ModelSection):
    """Everything a training run is: the sections of `TRAIN_SECTIONS` (a dataclass lists the fields of its bases
    last base first, so they are listed here in reverse)."""

    name = "train"
    title = "Options"
    # not a field: whether the pairs per step are the user's choice (a flag or YAML key), not a default of fastdpo's or
    # of the tool whose flags were given; set by `build_config`, None when unknown (a config built in Python)
    step_chosen = None

    def __post_init__(self) -> None:
        if self.learning_rate is None:  # the rate that trains what --train_type trains
            self.learning_rate = LORA_LEARNING_RATE if self.uses_lora else FULL_LEARNING_RATE
        self.normalise_datasets()

    @classmethod
    def from_sections(cls, *sections: Section, **flags) -> TrainConfig:
        """A config from section objects (`TrainConfig.from_sections(ModelSection(model="m"), LossSection(beta=0.2),
        dataset=["d.jsonl"])`), flags given by name winning."""
        values: dict = {}
        for section in sections:
            values.update({f.name: getattr(section, f.name) for f in dataclasses.fields(section)})
        return cls(**{**values, **flags})

    def sections(self) -> dict[str, Section]:
        """This config as its sections, by name (copies: a change to one is not a change to the config)."""
        return {sec.name: sec(**{f.name: getattr(self, f.name) for f in dataclasses.fields(sec)})
                for sec in TRAIN_SECTIONS}

    def normalise_datasets(self) -> None:
        """dataset / val_dataset as lists of specs: a single path, rows in memory and HF datasets become specs."""
        DataSection.normalise_datasets(self)
        self.normalise_val_datasets()

    def validate_training(self) -> None:
        """`validate`, plus what only training (not scoring or generating) cannot do."""
        self.validate()
        self.validate_hub()
        if self.uses_lora and self.learning_rate < LORA_LEARNING_RATE / 5:
            log.warning("--learning_rate %g with --train_type %s: LoRA adapters start at zero, and at a full fine-tune's "
                        "rate they barely move (LoRA DPO usually trains at 5e-6 to 1e-4; leave the flag out for %g).",
                        self.learning_rate, self.train_type, LORA_LEARNING_RATE)
        if self.fp8_base and self.device == "cpu":
            raise FastDPOError("--fp8_base needs a CUDA GPU with FP8 tensor cores (Ada or Hopper, compute capability "
                               "8.9 or newer), and --device cpu trains on the CPU. Drop --fp8_base (plain --train_type "
                               "lora).")
        if self.fp8 and self.device == "cpu":
            raise FastDPOError("--fp8 needs a CUDA GPU with FP8 tensor cores (Ada or Hopper, compute capability 8.9 or "
                               "newer), and --device cpu trains on the CPU. Drop --fp8 (bf16 training).")
        if self.torch_dtype == "float16" and self.train_type == "full":
            raise FastDPOError(
                "--torch_dtype float16 (or --fp16 true) with --train_type full: AdamW's updates and second moments do "
                "not fit in float16 weights (they underflow, and the weights turn to NaN within a few steps). Use "
                "--torch_dtype bfloat16 (fastdpo rounds its updates stochastically), float32, or --train_type lora "
                "on the float16 base (the adapters train in float32).")

    def validate(self) -> None:
        """Each section's checks, then those across sections; raise FastDPOError naming the flag and a fix."""
        self.validate_model()
        self.validate_data()
        self.validate_lora()
        self.validate_batching()
        self.validate_optimizer()
        self.validate_profiling()
        self.validate_parallel()
        self.validate_monitoring()
        if self.activation_offloading and (self.deepspeed or self.fsdp not in ("", "no_shard")):
            raise FastDPOError("--activation_offloading works with one GPU or DDP, not with FSDP2 sharding (it would "
                               "copy the gathered weights too). Drop one of the two.")
        if self.fp8 and self.torch_compile:
            raise FastDPOError("--fp8 with --torch_compile: the compiled layers would trace through the FP8 products' "
                               "quantisation and their shared inputs, which are not built for it. Drop one of the two "
                               "(--fp8 brings its own fused kernels).")
        if self.sequence_parallel_size > 1 and self.attn_impl == "padded":
            raise FastDPOError("--sequence_parallel_size splits the packed row, which --attn_impl padded does not use. "
                               "Use --attn_impl auto (or dense / varlen / flex).")
        self.validate_loss()
        self._validate_unpaired_across()
        self.validate_reference()
        self._validate_reference_across()
        self.validate_evaluation()
        if self.has_held_out and self.eval_steps > 0 and self.save_steps > 0 and self.save_steps % self.eval_steps:
            raise FastDPOError(f"--save_steps {self.save_steps} must be a multiple of --eval_steps {self.eval_steps}, so "
                               "every checkpoint has an evaluation to rank it by.")
        parallel_plan(self.fsdp, self.deepspeed, self)  # raises on what cannot be honoured

    def _validate_unpaired_across(self) -> None:
        """What an unpaired loss (KTO) needs of the other sections: TRL's rules for its KL estimate."""
        if not self.trains_unpaired():
            return
        from fastdpo.losses import needs_kl_completions  # imported on use: the losses load torch

        names = [name for name, _ in self.loss_terms()]
        if needs_kl_completions(names) and self.per_device_train_batch_size <= 1:
            raise FastDPOError(f"--loss_type {names[0]} estimates its KL term from each batch of "
                               "--per_device_train_batch_size rows, with every completion moved to the next row's "
                               "prompt; with 1 row the estimate is the row's own reward. Use "
                               "--per_device_train_batch_size 2 or more (as TRL's KTOTrainer requires).")
        if self.streaming:
            raise FastDPOError(f"--loss_type {names[0]} with --streaming: its KL completions are built over the whole "
                               "dataset in order before training. Drop --streaming.")

    def _validate_reference_across(self) -> None:
        """The reference's flags against the model, the adapters and the loss."""
        if self.ref_adapters and self.ref_model:
            raise FastDPOError("Give either --ref_model or --ref_adapters (applied to --model), not both.")
        if self.sync_ref_model:
            if not self.needs_reference():
                raise FastDPOError("--sync_ref_model has no reference to update: the loss is reference-free.")
            if self.uses_lora:
                raise FastDPOError("--sync_ref_model (TR-DPO) needs full fine-tuning: a LoRA reference is the "
                                   "base model itself. Use --train_type full.")
            if self.precompute_ref_log_probs:
                raise FastDPOError("--sync_ref_model changes the reference during training, so it cannot be "
                                   "precomputed. Drop --precompute_ref_log_probs.")

    def validate_data(self) -> None:
        """The data flags (also used by `fastdpo check-data`), and what streaming rules out in other sections."""
        self.validate_datasets()
        if self.streaming:  # the data is read once, lazily: nothing may need all of it ahead
            if self.max_steps <= 0:
                raise FastDPOError("--streaming needs --max_steps > 0: the size of a streamed dataset is not known ahead.")
            if self.max_samples:
                raise FastDPOError(f"--max_samples {self.max_samples} with --streaming: write each dataset as "
                                   f"`path#{self.max_samples}` instead (a stream takes its first N rows).")
            if self.split_dataset_ratio > 0:
                raise FastDPOError("--streaming cannot hold out --split_dataset_ratio of a stream. Give --val_dataset.")
            if self.precompute_ref_log_probs:
                raise FastDPOError("--precompute_ref_log_probs needs every training pair ahead, which --streaming does "
                                   "not have. Drop it: the reference then runs alongside the policy.")
            if str(self.gradient_checkpointing) == "auto":
                raise FastDPOError("--gradient_checkpointing auto measures on data in memory. With --streaming, name a "
                                   "policy: none, full, ffn, attn or every:K.")
        self.validate_reading()

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)
