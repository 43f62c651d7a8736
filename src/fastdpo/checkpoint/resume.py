"""Which checkpoint a run resumes from (DESIGN §9): each candidate verified before it is trusted (its files, sizes,
content manifest and step counter: `checkpoint_problem`), `latest` naming each one it skipped and why; a checkpoint
past the end of the run refused; and the metrics log trimmed back to the resumed step. Loading it is `restore`."""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

from fastdpo.checkpoint import manifest
from fastdpo.checkpoint.layout import (
    DONE,
    MANIFEST,
    NAME,
    STATE,
    complete_checkpoints,
    load_progress,
    numbered_checkpoints,
    size_problem,
    unverified,
)
from fastdpo.errors import FastDPOError

log = logging.getLogger("fastdpo")


def checkpoint_problem(ckpt: Path, trust_unverified: bool = False) -> str | None:
    """Why `ckpt` cannot be resumed, in words, or None: files missing or of another size, content that differs from
    its manifest (a flipped bit, a swapped file), a file the manifest does not list, no manifest at all (unless
    `trust_unverified`), or a step counter that is not a step of this checkpoint."""
    if not ckpt.is_dir():
        return "no such directory"
    if unverified(ckpt) and not trust_unverified:
        return (f"{MANIFEST} is missing, so its content cannot be verified (checkpoints of fastdpo before content "
                "manifests have none); pass --trust_unverified_checkpoint true to resume it unverified")
    problem = size_problem(ckpt, manifest_needed=not trust_unverified)
    if problem:
        return problem
    state = json.loads((ckpt / STATE / DONE).read_text())
    step, m = state.get("step"), NAME.match(ckpt.name)
    if not isinstance(step, int) or isinstance(step, bool) or step < 1 or (m and int(m.group(1)) != step):
        return f"its step counter ({step!r} in {STATE}/{DONE}) is not the step {ckpt.name} was written at"
    for key in ("pairs_per_step", "epoch", "world_size"):
        value = state.get(key)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < (key != "epoch")):
            return f"its {key} ({value!r} in {STATE}/{DONE}) is not a count"
    return None if unverified(ckpt) else manifest.check_manifest(ckpt, MANIFEST)


# ---------------------------------------------------------------- choosing


def resolve_resume(spec: str, out_dir: Path, start_over: bool = False, trust_unverified: bool = False) -> Path | None:
    """The checkpoint --resume_from_checkpoint names, its content verified. `latest`: the newest one that passes
    `checkpoint_problem`, naming each one skipped and why; None when `out_dir` holds no checkpoint (a run that starts
    from step 0). When checkpoints exist but none is usable, a FastDPOError, unless `start_over` (then None).
    `trust_unverified`: a checkpoint without a content manifest may be chosen (with a warning)."""
    if not spec:
        return None
    if spec != "latest":
        p = Path(spec)
        problem = checkpoint_problem(p, trust_unverified)
        if problem:
            raise FastDPOError(
                f"--resume_from_checkpoint {spec}: not a complete fastdpo checkpoint ({problem}). Use `latest` or one "
                f"of: {', '.join(c.name for c in complete_checkpoints(out_dir)) or 'none found'}."
            )
        return _trusted(p)
    candidates = numbered_checkpoints(out_dir)
    if not candidates:
        log.info("--resume_from_checkpoint latest: no checkpoint in %s yet; starting from step 0.", out_dir)
        return None
    skipped = []
    for p in candidates:
        problem = checkpoint_problem(p, trust_unverified)
        if problem is None:
            if skipped:
                log.warning("--resume_from_checkpoint latest: skipped %s; resuming from %s.", "; ".join(skipped), p)
            return _trusted(p)
        skipped.append(f"{p.name} ({problem})")
    text = (f"--resume_from_checkpoint latest: none of the {len(candidates)} checkpoints in {out_dir} can be "
            f"resumed: {'; '.join(skipped)}.")
    if start_over:
        log.warning("%s --start_over_if_unusable: training from step 0.", text)
        return None
    raise FastDPOError(f"{text} Resume one you trust by its path, remove the broken ones, or pass "
                       "--start_over_if_unusable true to train from step 0.")


def _trusted(ckpt: Path) -> Path:
    if unverified(ckpt):
        log.warning("%s has no content manifest (%s): resuming it unverified, as --trust_unverified_checkpoint true "
                    "asks.", ckpt, MANIFEST)
    return ckpt


def check_resume_step(resume: Path, total_steps: int) -> int:
    """The step `resume` continues from; a FastDPOError when it lies past the end of this run."""
    step = load_progress(resume)["step"]
    if step > total_steps:
        raise FastDPOError(f"{resume} was written at step {step}, past the {total_steps} steps this run trains "
                           "(--max_steps / --num_train_epochs). Raise them to continue it, or resume an earlier "
                           "checkpoint by its path.")
    return step


def warn_later_checkpoints(out_dir: Path, start: int) -> None:
    """Checkpoints past the step this run starts at come from another run; `latest` would pick them after a kill."""
    later = [p.name for p in complete_checkpoints(out_dir) if int(p.name.split("-")[1]) > start]
    if later:
        log.warning("%s already holds %s from an earlier run, past step %d where this run starts; after an "
                    "interruption `--resume_from_checkpoint latest` would pick those. Remove them or use a fresh "
                    "--output_dir.", out_dir, ", ".join(later[-3:]), start)


# ---------------------------------------------------------------- the metrics log


def _step_record(line: str) -> dict | None:
    try:
        record = json.loads(line)
    except ValueError:
        return None
    return record if isinstance(record, dict) and isinstance(record.get("step"), int) else None


def split_metrics(text: str, step: int) -> tuple[list[str], list[int]]:
    """The lines of a metrics.jsonl `text` whose records are at or before `step`, and the numbers (from 1) of the
    lines that are not a step record. An unterminated last line is a write a kill interrupted, past any checkpoint,
    and is not counted."""
    lines = text.split("\n")
    keep, unreadable = [], []
    for number, line in enumerate(lines, 1):
        record = _step_record(line)
        if record is None:
            if line.strip() and number < len(lines):
                unreadable.append(number)
        elif record["step"] <= step:
            keep.append(line + "\n")
    return keep, unreadable


def truncate_metrics(path: Path, step: int) -> None:
    """Keep only the complete metrics.jsonl records up to `step`: after a resume from there, the log continues as
    if the run had never been interrupted (no repeated steps, no torn last line). Lines that cannot be read are
    named in a warning, and the file as it was is kept as metrics.jsonl.bak-{step}."""
    if not path.is_file():
        return
    text = path.read_text(encoding="utf-8", errors="replace")
    keep, unreadable = split_metrics(text, step)
    if unreadable:
        backup = path.with_name(f"{path.name}.bak-{step}")
        shutil.copy2(path, backup)
        which = f"line {unreadable[0]}" if len(unreadable) == 1 else f"lines {', '.join(map(str, unreadable))}"
        log.warning("%s: %s could not be read and %s dropped when the log was trimmed to step %d for the resume; the "
                    "file as it was is kept as %s.", path, which, "was" if len(unreadable) == 1 else "were", step,
                    backup)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text("".join(keep), encoding="utf-8")
    os.replace(tmp, path)
