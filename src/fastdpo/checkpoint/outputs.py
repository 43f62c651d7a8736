"""Which files in an output dir are a run's: `.fastdpo-outputs.json` lists the names fastdpo runs created there, so a
fresh run refuses to write over a file of the same name that is not on it (the --config file is never written over)
and only what is on it is ever removed."""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

from fastdpo.checkpoint.layout import DONE, STATE, numbered_checkpoints
from fastdpo.config import TrainConfig, report_targets

# what a training run writes into its output dir (checkpoint-N/ too); --overwrite_output_dir removes these
RUN_FILES = ("metrics.jsonl", "alerts.jsonl", "config.yaml", "data_summary.json", "summary.json", "metrics.png",
             "train.log")
RUN_DIRS = ("final", "runs", "profile")
RECORD = ".fastdpo-outputs.json"  # the names fastdpo runs created in the dir: only these are ever removed
_NUMBERED = re.compile(r"^(checkpoint-\d+|metrics\.jsonl\.bak-\d+)$")


def is_output_name(name: str) -> bool:
    """A name a training run writes in its output dir."""
    return name in RUN_FILES or name in RUN_DIRS or bool(_NUMBERED.match(name))


def names_in(out: Path) -> set[str]:
    try:
        return set(os.listdir(out))
    except OSError:
        return set()


def _read_record(out: Path) -> dict | None:
    try:
        record = json.loads((out / RECORD).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) and isinstance(record.get("created"), list) else None


def run_outputs(out: Path) -> set[str]:
    """The names in `out` that fastdpo runs created: those on its record, and for a run that ended before it could
    update the record (killed), the output names that appeared since it started. A dir without a record holding a
    checkpoint is a run dir of a fastdpo that kept none: its output names count as that run's."""
    present = names_in(out)
    record = _read_record(out)
    if record is None:
        checkpoints = [p for p in numbered_checkpoints(out) if (p / STATE / DONE).is_file()]
        return {n for n in present if is_output_name(n)} if checkpoints else set()
    created = set(map(str, record["created"]))
    before = record.get("started_with")
    if isinstance(before, list):
        created |= {n for n in present if is_output_name(n) and n not in before}
    return created & present


def write_record(out: Path, created: set[str], started_with: set[str] | None) -> None:
    record = {"created": sorted(created), "started_with": None if started_with is None else sorted(started_with)}
    tmp = out / f"{RECORD}.tmp"
    tmp.write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
    os.replace(tmp, out / RECORD)


def config_file() -> Path | None:
    """The --config file of this process's command line, if any."""
    args = sys.argv[1:]
    for i, a in enumerate(args):
        if a == "--config" and i + 1 < len(args):
            return Path(args[i + 1])
        if a.startswith("--config="):
            return Path(a.split("=", 1)[1])
    return None


def is_config_file(path: Path) -> bool:
    given = config_file()
    try:
        return given is not None and path.exists() and given.exists() and os.path.samefile(given, path)
    except OSError:
        return False


def names_written(cfg: TrainConfig, out: Path) -> list[str]:
    """The fixed names this run writes in `out` (checkpoints aside); config.yaml not when it is the --config file."""
    names = ["config.yaml", "metrics.jsonl", "alerts.jsonl", "data_summary.json", "summary.json", "train.log", "final"]
    if is_config_file(out / "config.yaml"):
        names.remove("config.yaml")
    if cfg.plot:
        names.append("metrics.png")
    if "tensorboard" in report_targets(cfg.report_to) and not cfg.logging_dir:
        names.append("runs")
    if cfg.profile_steps:
        names.append("profile")
    return names


def foreign_files(cfg: TrainConfig, out: Path) -> list[str]:
    """Names this run would write over in `out` that no fastdpo run created there (the user's own files)."""
    present, owned = names_in(out), run_outputs(out)
    return [n for n in names_written(cfg, out) if n in present and n not in owned]
