"""The held-out split: --val_dataset rows, or a seeded --split_dataset_ratio share of the training rows."""

from __future__ import annotations

import math
import random

from fastdpo.data.columns import RowOptions
from fastdpo.data.kinds import check_row_kinds
from fastdpo.data.load import Row, load_rows
from fastdpo.errors import FastDPOError


def split_rows(rows: list[Row], ratio: float, seed: int) -> tuple[list[Row], list[Row]]:
    """Hold out ceil(ratio x rows) rows, chosen with `seed`; both parts keep the file order."""
    n_val = math.ceil(ratio * len(rows))
    if n_val >= len(rows):
        raise FastDPOError(f"--split_dataset_ratio {ratio} leaves no training rows out of {len(rows)}. Lower it.")
    order = list(range(len(rows)))
    random.Random(seed).shuffle(order)
    held = set(order[:n_val])
    return [r for i, r in enumerate(rows) if i not in held], [r for i, r in enumerate(rows) if i in held]


def held_out_rows(cfg, rows: list[Row], read: RowOptions | None = None) -> tuple[list[Row], list[Row]]:
    """(training rows, validation rows) per --val_dataset or --split_dataset_ratio (no validation rows otherwise);
    --val_dataset read as `read` says (default: as `cfg` reads rows, without images)."""
    if cfg.val_dataset:
        val_rows = load_rows(cfg.val_dataset, cfg.seed, cfg.val_split, read=read or RowOptions.from_config(cfg))
        check_row_kinds(rows + val_rows, "--dataset and --val_dataset")  # one loss scores both
        return rows, val_rows
    if cfg.split_dataset_ratio > 0:
        return split_rows(rows, cfg.split_dataset_ratio, cfg.seed)
    return rows, []
