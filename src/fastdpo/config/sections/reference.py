"""The reference section: how the reference model's log-probs are had (alongside the policy, or precomputed and
cached) and whether the reference follows the policy (TR-DPO). Which model it is: `--ref_model` / `--ref_adapters`."""

from __future__ import annotations

from dataclasses import dataclass

from fastdpo.config.fields import Section, option
from fastdpo.errors import FastDPOError


@dataclass
class ReferenceSection(Section):
    """Where the reference's log-probs come from, and whether the reference moves."""

    name = "reference"
    title = "Reference model"

    precompute_ref_log_probs: bool = option(False, "Compute reference log-probs once before training (cached on disk) "
                                            "and hold no reference model while training.")
    precompute_ref_batch_size: int = option(0, "Pairs per forward of the precompute pass (0: 4x per_device_train_batch_size; "
                                            "with --max_tokens_per_batch, a 4x token budget).")
    ref_cache_dir: str = option("", "Reference cache dir (default $FASTDPO_CACHE_DIR/ref_logps or ~/.cache/fastdpo/ref_logps).")
    sync_ref_model: bool = option(False, "TR-DPO: every --ref_model_sync_steps, ref = alpha * policy + (1 - alpha) * ref.")
    ref_model_mixup_alpha: float = option(0.6, "TR-DPO mix-up weight alpha of the policy.")
    ref_model_sync_steps: int = option(512, "TR-DPO: optimizer steps between reference updates.")

    def validate_reference(self) -> None:
        if self.precompute_ref_batch_size < 0:
            raise FastDPOError(f"--precompute_ref_batch_size must be >= 0, got {self.precompute_ref_batch_size}.")
        if self.sync_ref_model and (not 0 <= self.ref_model_mixup_alpha <= 1 or self.ref_model_sync_steps < 1):
            raise FastDPOError("TR-DPO needs --ref_model_mixup_alpha in [0, 1] and --ref_model_sync_steps >= 1.")
