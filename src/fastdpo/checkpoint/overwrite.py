"""The outputs of an earlier run in --output_dir: a fresh run (no --resume_from_checkpoint) into a dir that holds
another run's checkpoints, final model or metrics log is refused with the choices spelled out, or with
--overwrite_output_dir true those outputs (and only those: `outputs.run_outputs`) are removed first."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

from fastdpo.checkpoint.layout import numbered_checkpoints
from fastdpo.checkpoint.outputs import RECORD, RUN_DIRS, RUN_FILES, foreign_files, is_config_file, run_outputs
from fastdpo.checkpoint.publish import clean_partial, remove_published
from fastdpo.config import MonitoringSection, TrainConfig
from fastdpo.errors import FastDPOError

log = logging.getLogger("fastdpo")


def _metrics_steps(path: Path) -> int:
    try:
        return sum(1 for line in path.read_text(encoding="utf-8", errors="replace").splitlines() if line.strip())
    except OSError:
        return 0


def earlier_outputs(out: Path) -> list[Path]:
    """The checkpoints, final model and (non-empty) metrics log an earlier run left in `out`."""
    if not out.is_dir():
        return []
    found = numbered_checkpoints(out)[::-1]
    if (out / "final").is_dir():
        found.append(out / "final")
    if _metrics_steps(out / "metrics.jsonl"):
        found.append(out / "metrics.jsonl")
    return found


def describe_outputs(found: list[Path]) -> str:
    checkpoints = [p.name for p in found if p.name.startswith("checkpoint-")]
    parts = [", ".join(checkpoints) if len(checkpoints) <= 3 else
             f"{len(checkpoints)} checkpoints ({checkpoints[0]} to {checkpoints[-1]})"] if checkpoints else []
    if any(p.name == "final" for p in found):
        parts.append("final/")
    for p in found:
        if p.name == "metrics.jsonl":
            parts.append(f"metrics.jsonl ({_metrics_steps(p)} logged steps)")
    return ", ".join(parts)


def remove_run_outputs(out: Path, cfg: MonitoringSection) -> list[str]:
    """Delete what fastdpo runs created in `out`, as its record says, never another file (checkpoints and final/
    first, each renamed to a hidden name before it is removed, so a kill midway leaves no half-deleted checkpoint
    under its name). Returns the names."""
    owned = run_outputs(out)
    removed = []
    for p in earlier_outputs(out):
        if p.is_dir() and p.name in owned:
            remove_published(p)
            removed.append(p.name)
    for name in (*RUN_FILES, *sorted(n for n in owned if n.startswith("metrics.jsonl.bak-"))):
        if name in owned and (out / name).is_file() and not is_config_file(out / name):
            (out / name).unlink()
            removed.append(name)
    for name in RUN_DIRS:
        if name == "runs" and cfg.logging_dir:  # TensorBoard's default dir only: a --logging_dir is the user's
            continue
        if name in owned and (out / name).is_dir():
            shutil.rmtree(out / name)
            removed.append(name)
    clean_partial(out)
    return removed


def check_earlier_run(cfg: TrainConfig, out: Path) -> None:
    """Refuse a fresh run into a dir that holds another run's outputs (or, with --overwrite_output_dir, remove
    them). A resume with `latest` that finds no checkpoint but a final model counts as fresh: there is nothing to
    continue, and it would replace that run's final model and metrics."""
    found = earlier_outputs(out)
    if cfg.resume_from_checkpoint:
        continues = cfg.resume_from_checkpoint != "latest" or any(p.name.startswith("checkpoint-") for p in found)
        if continues:
            if cfg.overwrite_output_dir:
                log.info("--overwrite_output_dir has no effect when resuming (--resume_from_checkpoint %s).",
                         cfg.resume_from_checkpoint)
            return
    foreign = foreign_files(cfg, out)
    if foreign:
        raise FastDPOError(
            f"--output_dir {out} holds {', '.join(foreign)}, which this run would write over, and no fastdpo run "
            f"wrote {'it' if len(foreign) == 1 else 'them'} there (they are not in {out / RECORD}). fastdpo never writes "
            "over or deletes files of your own, --overwrite_output_dir true included. Choose another --output_dir, "
            f"or move {'it' if len(foreign) == 1 else 'them'} out of {out}."
        )
    finished = bool(cfg.resume_from_checkpoint) and (out / "final").is_dir()
    if not found or (cfg.resume_from_checkpoint and not finished):
        return  # `latest` with no checkpoint yet: a first attempt starts from step 0
    what = describe_outputs(found)
    if cfg.overwrite_output_dir:
        removed = remove_run_outputs(out, cfg)
        log.warning("--overwrite_output_dir: removed the earlier run's outputs from %s (%s).", out, ", ".join(removed))
        return
    if finished:
        raise FastDPOError(
            f"--resume_from_checkpoint latest: {out} holds a finished run ({what}) but no checkpoint to continue from "
            "(it ran without --save_steps, so only its final model was kept), so it cannot be continued exactly. To "
            f"train it further, start a new run from its final model in another dir: `--model {out / 'final'} "
            f"--output_dir {out}-more` without --resume_from_checkpoint (a LoRA run: keep --model and add `--adapters "
            f"{out / 'final'}`); or pass --overwrite_output_dir true to remove its outputs and start over. Runs with "
            "--save_steps keep a checkpoint at their last step and can be extended with --resume_from_checkpoint "
            "latest and a higher --max_steps or --num_train_epochs."
        )
    resume = ("--resume_from_checkpoint latest to continue it (after raising --max_steps or --num_train_epochs, for a "
              "finished run); " if any(p.name.startswith("checkpoint-") for p in found) else "")
    raise FastDPOError(
        f"--output_dir {out} holds the outputs of an earlier run ({what}). A new run there would replace its final "
        "model and metrics log, and a later --resume_from_checkpoint latest would pick up its checkpoints. Choose "
        f"one: {resume}another --output_dir; or --overwrite_output_dir true to remove its outputs and start over."
    )
