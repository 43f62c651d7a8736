"""The optimizer and schedule section: how long, at what learning rate, with which AdamW settings."""

from __future__ import annotations

from dataclasses import dataclass

from fastdpo.config.fields import Section, check_choice, option
from fastdpo.errors import FastDPOError

LR_SCHEDULERS = ("linear", "cosine", "cosine_with_min_lr", "constant", "constant_with_warmup")
MAX_LR = 1e6  # far past any useful rate, far below where AdamW's step size overflows float32
FULL_LEARNING_RATE, LORA_LEARNING_RATE = 5e-7, 5e-6  # --learning_rate left out (TRL's LoRA DPO example uses 5e-6)


@dataclass
class OptimizerSection(Section):
    """The optimizer steps: how many, their learning-rate schedule, and AdamW's settings."""

    name = "optimizer"
    title = "Optimizer and schedule"

    max_steps: int = option(-1, "Optimizer steps to run (overrides num_train_epochs when > 0).")
    num_train_epochs: float = option(1.0, "Epochs over the dataset.")
    learning_rate: float | None = option(None, "Peak learning rate. Unset: 5e-7 for --train_type full, 5e-6 for LoRA and "
                                         "QLoRA, whose adapters start at zero and take larger steps (TRL's and ms-swift's LoRA "
                                         "DPO recipes use 5e-6 to 1e-4; 5e-7 barely moves an adapter).",
                                     default_text="5e-7 (full), 5e-6 (lora, qlora)")
    lr_scheduler_type: str = option("linear", "linear|cosine|cosine_with_min_lr|constant|constant_with_warmup.")
    lr_scheduler_kwargs: dict = option({}, "JSON dict for the scheduler, e.g. '{\"min_lr\": 1e-7}'.")
    warmup_ratio: float = option(0.0, "Fraction of steps for linear warm-up.")
    warmup_steps: int = option(0, "Warm-up steps (overrides warmup_ratio when > 0).")
    weight_decay: float = option(0.0, "AdamW weight decay.")
    adam_beta1: float = option(0.9, "AdamW beta1.")
    adam_beta2: float = option(0.999, "AdamW beta2.")
    adam_epsilon: float = option(1e-8, "AdamW epsilon.")
    max_grad_norm: float = option(1.0, "Gradient clipping norm (0 disables).")
    update_rounding: str = option("stochastic", "How AdamW writes updates into bfloat16 weights: stochastic (unbiased: "
                                  "updates far below bf16's precision, as at lr 1e-6, still count on average) or nearest "
                                  "(torch.optim.AdamW, fused on CUDA: such updates mostly round away).")

    def validate_optimizer(self) -> None:
        check_choice("lr_scheduler_type", self.lr_scheduler_type, LR_SCHEDULERS)
        check_choice("update_rounding", self.update_rounding, ("stochastic", "nearest"))
        if self.max_steps <= 0 and self.num_train_epochs <= 0:
            raise FastDPOError("Set --max_steps > 0 or --num_train_epochs > 0.")
        if not 0 <= self.warmup_ratio < 1:
            raise FastDPOError(f"--warmup_ratio must be in [0, 1), got {self.warmup_ratio}.")
        if self.learning_rate is not None and not 0 <= self.learning_rate <= MAX_LR:  # also refuses NaN
            raise FastDPOError(f"--learning_rate must be a number from 0 to {MAX_LR:g} (DPO uses 1e-7 to 1e-4), got "
                               f"{self.learning_rate}.")
