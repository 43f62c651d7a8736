"""Helpers for the checkpoint tests (here and in tests of the whole run)."""

import json
from pathlib import Path

from fastdpo import checkpoint as ckpt
from fastdpo.checkpoint import manifest


def reseal(c: Path) -> None:
    """Make trainer_state.json's sizes and the manifest agree with the files as they are now: an edit that is
    consistent (another tool's file, or an older checkpoint), so what loads is checked, not the manifest."""
    done = c / ckpt.STATE / ckpt.DONE
    state = json.loads(done.read_text())
    skip = {f"{ckpt.STATE}/{ckpt.DONE}", ckpt.MANIFEST}
    state["files"] = {str(p.relative_to(c)): p.stat().st_size for p in sorted(c.rglob("*"))
                      if p.is_file() and str(p.relative_to(c)) not in skip}
    done.write_text(json.dumps(state))
    manifest.write_manifest(c, ckpt.MANIFEST)
