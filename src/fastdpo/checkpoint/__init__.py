"""The checkpoint room (DESIGN §9): the run's life on disk, between the parallel floor below and the training loop
above. `checkpoint-N/` = the model (HF safetensors dir or PEFT adapter; `sharded/` for a multi-rank run) + `state/`
(optimizer, scheduler, RNG, progress, resolved config, content manifest). Files by job:

- `layout`: what a checkpoint dir holds, finding the complete ones, reading their progress and config;
- `publish`: atomic, fsynced publishing of a written dir, the leftovers of an interrupted write put back or removed;
- `save`: the one skeleton that writes checkpoints (one process or sharded) and the final model;
- `manifest`: content hashes written last into a dir and checked before it is trusted;
- `rotation`: --save_total_limit; `disk`: the pre-flight and the error a failed write becomes;
- `resume`: which checkpoint a resume continues from, verified; `restore`: loading it into the run;
- `identity`: what a run is (model, data, settings), compared on resume; `saved_run`: the config of a run's model;
- `ownership` (with `lock`, `outputs`, `overwrite`): a run holds its output dir and touches only its own files.

The loop's checkpoint calls are here by name (`from fastdpo import checkpoint as ckpt`; `ckpt.save_checkpoint`)."""

from fastdpo.checkpoint.disk import TOKENIZER_FILES, check_disk_space, estimate_checkpoint_bytes, write_failed
from fastdpo.checkpoint.layout import (
    DONE,
    MANIFEST,
    SHARDED,
    STATE,
    complete_checkpoints,
    is_complete,
    is_sharded,
    load_progress,
    numbered_checkpoints,
    read_config,
    saved_config,
    unverified,
)
from fastdpo.checkpoint.publish import clean_partial, recover, remove_published
from fastdpo.checkpoint.resume import (
    check_resume_step,
    checkpoint_problem,
    resolve_resume,
    split_metrics,
    truncate_metrics,
    warn_later_checkpoints,
)
from fastdpo.checkpoint.rng import rng_state, set_rng_state
from fastdpo.checkpoint.rotation import rotate
from fastdpo.checkpoint.save import save_checkpoint, save_final, save_sharded_checkpoint

__all__ = [
    "DONE", "MANIFEST", "SHARDED", "STATE", "TOKENIZER_FILES", "check_disk_space", "check_resume_step",
    "checkpoint_problem", "clean_partial", "complete_checkpoints", "estimate_checkpoint_bytes", "is_complete",
    "is_sharded", "load_progress", "numbered_checkpoints", "read_config", "recover", "remove_published",
    "resolve_resume", "rng_state", "rotate", "save_checkpoint", "save_final", "save_sharded_checkpoint",
    "saved_config", "set_rng_state", "split_metrics", "truncate_metrics", "unverified", "warn_later_checkpoints",
    "write_failed",
]
