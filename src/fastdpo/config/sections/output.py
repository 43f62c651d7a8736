"""The output section: where a run writes, how often it saves, how it resumes, and where the model is uploaded
(`HubSection`, shared with `fastdpo export`)."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

from fastdpo.config.fields import Section, option
from fastdpo.errors import FastDPOError

log = logging.getLogger("fastdpo")


@dataclass
class HubSection(Section):
    """The Hugging Face Hub repo the result is uploaded to."""

    name = "hub"
    title = "Hugging Face Hub"

    push_to_hub: bool = option(False, "At the end, upload the result (train: final/, the model or the LoRA adapter; "
                               "export: the merged model) to a Hugging Face Hub model repo, created if missing "
                               "(huggingface_hub; log in with `hf auth login` or HF_TOKEN).")
    hub_model_id: str = option("", "The repo --push_to_hub uploads to: NAME or OWNER/NAME (default: the --output_dir name).")
    hub_private_repo: bool = option(False, "Create the --push_to_hub repo as a private one.")

    def validate_hub(self) -> None:
        """A push that cannot happen is refused now, not after hours of training."""
        check_push(self.push_to_hub, self.hub_model_id)


@dataclass
class OutputSection(Section):
    """The run on disk: its directory, checkpoints and resume."""

    name = "output"
    title = "Output and checkpoints"

    output_dir: str = option("output", "Where checkpoints, metrics and the final model go.")
    save_steps: int = option(0, "Checkpoint every N optimizer steps (0: only the final model).")
    save_total_limit: int = option(0, "Keep at most N checkpoints (0: keep all).")
    resume_from_checkpoint: str = option("", "Checkpoint dir, or `latest` for the newest one in output_dir whose content "
                                         "matches its manifest (each one skipped is named, with why).")
    resume_ignore_changes: bool = option(False, "Resume even when the checkpoint was trained with another model, other "
                                         "data, or other settings that change the objective, the optimizer's update or "
                                         "the data order (loss, beta, torch_dtype, weight_decay, adam_beta1, "
                                         "max_grad_norm, seed, max_length, ...): each difference is logged. Off: such a "
                                         "resume is refused, naming each old → new. Learning-rate, length, logging, "
                                         "saving and speed flags may always change.")
    start_over_if_unusable: bool = option(False, "With --resume_from_checkpoint latest: when output_dir holds checkpoints "
                                          "but none can be resumed (corrupt, incomplete), train from step 0 instead of "
                                          "stopping.")
    trust_unverified_checkpoint: bool = option(False, "Resume a checkpoint that has no content manifest (state/manifest.json: "
                                               "written by fastdpo before manifests, or removed since); its files are "
                                               "loaded unverified (logged). Off: such a checkpoint is refused.")
    overwrite_output_dir: bool = option(False, "A new run (no --resume_from_checkpoint) into an output_dir that holds an "
                                        "earlier run's checkpoints, final/ or metrics.jsonl is refused; true removes "
                                        "those outputs first (logged).")


def check_push(push_to_hub: bool, hub_model_id: str) -> None:
    """--push_to_hub / --hub_model_id, before any work: a push that cannot happen is refused now, not after hours
    of training."""
    if hub_model_id and not push_to_hub:
        log.warning("--hub_model_id %s without --push_to_hub: nothing is uploaded (add --push_to_hub).", hub_model_id)
    if not push_to_hub:
        return
    if os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on"):
        raise FastDPOError("--push_to_hub with HF_HUB_OFFLINE=1: nothing can be uploaded. Drop --push_to_hub and "
                           "upload the saved model later with `hf upload REPO DIR`, or unset HF_HUB_OFFLINE.")
    if hub_model_id.count("/") > 1 or hub_model_id.strip() != hub_model_id:
        raise FastDPOError(f"--hub_model_id {hub_model_id!r}: give a repo name, or OWNER/NAME.")
