"""--save_total_limit: which checkpoints a run deletes as it writes new ones (the oldest beyond the limit, never the
newest, the best or the one just written)."""

from __future__ import annotations

import logging
from pathlib import Path

from fastdpo.checkpoint.layout import complete_checkpoints
from fastdpo.checkpoint.publish import remove_published

log = logging.getLogger("fastdpo")


def rotate(out_dir: Path, limit: int, best: str | Path | None = None, keep: Path | None = None) -> None:
    """Delete the oldest complete checkpoints beyond `limit` (0 keeps all); never the newest, never `best`, never
    `keep` (the one just written, which is not the highest-numbered after resuming from an older checkpoint). As in
    HF, the best counts as one of the `limit` kept, so limit=1 keeps two when the best is not the newest."""
    if limit <= 0:
        return
    found = complete_checkpoints(out_dir)
    protected = {p.name for p in found[-1:]} | {Path(x).name for x in (best, keep) if x}
    protected &= {p.name for p in found}
    excess = len(found) - max(limit, len(protected))
    for p in [p for p in found if p.name not in protected][: max(0, excess)]:
        try:
            remove_published(p)
        except OSError as e:  # a checkpoint we could not delete costs disk space, not the run
            log.warning("--save_total_limit: could not delete %s (%s).", p, e.strerror or e)
