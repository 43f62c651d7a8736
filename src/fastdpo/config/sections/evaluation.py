"""The evaluation section: held-out pairs scored during training, how often, and the metric that ranks checkpoints."""

from __future__ import annotations

from dataclasses import dataclass

from fastdpo.config.fields import Section, option
from fastdpo.errors import FastDPOError

# Metrics of held-out pairs that can rank checkpoints (`--metric_for_best_model`, with or without `eval_`).
PAIR_METRICS = ("loss", "rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen",
                "logps/rejected")


def check_metric_name(name: str) -> None:
    bare = name.removeprefix("eval_")
    if bare not in PAIR_METRICS:
        raise FastDPOError(f"--metric_for_best_model {name!r} is not an eval metric. Choose from: "
                           f"{', '.join(PAIR_METRICS)} (with or without the eval_ prefix).")


@dataclass
class EvaluationSection(Section):
    """Held-out pairs and when they are scored."""

    name = "evaluation"
    title = "Evaluation during training"

    val_dataset: list = option([], "Held-out preference files (like --dataset) evaluated during training.", nargs="+")
    val_split: str = option("train", "Split to read from HF datasets in --val_dataset.")
    split_dataset_ratio: float = option(0.0, "Hold out this fraction of --dataset for evaluation (without --val_dataset).")
    eval_steps: int = option(0, "Evaluate every N optimizer updates (0: at every save and at the end) on the held-out pairs.")
    metric_for_best_model: str = option("loss", "Eval metric ranking checkpoints (loss, rewards/accuracies, ...); the best "
                                        "checkpoint is never rotated away.")
    greater_is_better: bool | None = option(None, "Whether larger metric_for_best_model is better (default: no for losses).")

    @property
    def has_held_out(self) -> bool:
        return bool(self.val_dataset) or self.split_dataset_ratio > 0

    def normalise_val_datasets(self) -> None:
        from fastdpo.data.sources import dataset_specs

        self.val_dataset = dataset_specs(self.val_dataset, self.val_split, "val_dataset")

    def validate_evaluation(self) -> None:
        if not 0 <= self.split_dataset_ratio < 1:
            raise FastDPOError(f"--split_dataset_ratio must be in [0, 1), got {self.split_dataset_ratio}.")
        if self.val_dataset and self.split_dataset_ratio > 0:
            raise FastDPOError("Give --val_dataset or --split_dataset_ratio, not both.")
        if self.eval_steps < 0:
            raise FastDPOError(f"--eval_steps must be >= 0, got {self.eval_steps}.")
        if self.eval_steps > 0 and not self.has_held_out:
            raise FastDPOError("--eval_steps needs held-out pairs: add --val_dataset FILE or --split_dataset_ratio R.")
        check_metric_name(self.metric_for_best_model)
