"""Writing checkpoints and the final model (DESIGN §9), all three through one skeleton, `write_published`: a staging
dir, each rank's own files written while a `Flusher` syncs them, the ranks' file digests gathered, rank 0's shared
files and the manifest, then the atomic publish; a failed write becomes one error that names the last good
checkpoint. What differs is plugged in:

- one process (`save_checkpoint`): the HF model dir or PEFT adapter, `optimizer.pt`, `rng.pt` and the extra modules
  as safetensors; the manifest hashes every file;
- several ranks (`save_sharded_checkpoint`): each rank writes its shards of model and optimizer in PyTorch's
  distributed checkpoint format (`sharded/`, through `parallel.sharded_state`; readable later on any number of
  ranks) and `rng-RANK.pt`, and hashes what it wrote; rank 0 adds the tokenizer and hashes the rest. `output_dir`
  must be shared by all nodes;
- the final model (`save_final`): the model dir alone, no training state.

Every checkpoint ends with `state/trainer_state.json` (the progress and every file's size) and the content manifest,
written last. Deleting the old ones is `rotation`."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import torch

from fastdpo.checkpoint import manifest
from fastdpo.checkpoint.disk import write_errors, write_failed
from fastdpo.checkpoint.layout import DONE, MANIFEST, SHARDED, STATE, sizes
from fastdpo.checkpoint.publish import Flusher, publish
from fastdpo.checkpoint.rng import rng_state
from fastdpo.config import save_config
from fastdpo.model.load import save_model
from fastdpo.parallel.distributed import Dist, barrier
from fastdpo.parallel.objects import gather_objects
from fastdpo.parallel.sharded_state import save_sharded, sharded_state

# A rank's own files, written into the staging dir; returns the digests it already took (relative path -> hex).
WriteOwn = Callable[[Path], dict[str, str]]
# Rank 0's files after every rank's own, given all the digests the ranks took.
WriteShared = Callable[[Path, dict[str, str]], None]


def write_published(out_dir: Path, name: str, what: str, own: WriteOwn, shared: WriteShared | None = None,
                    d: Dist | None = None, dirs: tuple[str, ...] = ()) -> Path:
    """Write `out_dir/name` atomically from every rank of `d` (each must call this; one process when None) and
    return its path. Rank 0 makes the staging dir `.NAME.tmp` (with `dirs` under it); every rank writes its `own`
    files there while a Flusher syncs them, and the digests the ranks took are gathered; rank 0 writes the `shared`
    files and publishes the dir. A failed write raises a FastDPOError naming `what` and the last good checkpoint;
    what was published before is untouched."""
    d = d or Dist()
    final, tmp = out_dir / name, out_dir / f".{name}.tmp"
    try:
        if d.is_main:
            if tmp.exists():
                shutil.rmtree(tmp)
            tmp.mkdir(parents=True)
            for sub in dirs:
                (tmp / sub).mkdir()
        barrier(d)  # the other ranks write into the dir rank 0 made
        with Flusher(tmp):  # the disk takes the files as they are written and hashed
            known = {k: v for part in gather_objects(own(tmp), d) for k, v in part.items()}
            if d.is_main and shared is not None:
                shared(tmp, known)
        if d.is_main:
            publish(tmp, final)
    except write_errors() as e:
        if d.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
        raise write_failed(what, out_dir, e) from None
    barrier(d)  # no rank goes on before the dir is published
    return final


def write_checkpoint(out_dir: Path, step: int, own: WriteOwn, scheduler, progress: dict, config,
                     d: Dist | None = None, tokenizer=None, plan=None) -> Path:
    """checkpoint-{step} through `write_published`: every rank's `own` files, then rank 0 writes the scheduler
    state, the config and the run's `plan` (what set-up resolved from it), `tokenizer` (when given) and, last,
    trainer_state.json and the manifest."""

    def shared(tmp: Path, known: dict[str, str]) -> None:
        st = tmp / STATE
        torch.save(scheduler.state_dict(), st / "scheduler.pt")
        save_config(config, st / "config.yaml")
        if plan is not None:
            plan.save(st)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        write_done(tmp, step, progress, known)

    name = f"checkpoint-{step}"
    return write_published(out_dir, name, name, own, shared, d, dirs=(STATE,))


def write_done(tmp: Path, step: int, progress: dict, known: dict[str, str] | None = None) -> None:
    """The last two files of a checkpoint: trainer_state.json (progress, and the size of every other file: a
    checkpoint is complete only if all of them match), then the manifest of every file's content hash (`known`:
    digests the ranks already took of the files they wrote)."""
    state = {"step": step, **progress, "files": sizes(tmp), "manifest": MANIFEST}
    (tmp / STATE / DONE).write_text(json.dumps(state, indent=1))
    manifest.write_manifest(tmp, MANIFEST, known)


def save_checkpoint(out_dir: Path, step: int, model, tokenizer, optimizer, scheduler, progress: dict, config,
                    extra_modules: dict | None = None, plan=None) -> Path:
    """Write checkpoint-{step} of a one-process run atomically and return its path. `extra_modules` (name -> module)
    are saved as state/{name}.safetensors (e.g. a reference model that training updates). A failed write raises a
    FastDPOError that names the last good checkpoint; the previous checkpoints are untouched."""

    def own(tmp: Path) -> dict[str, str]:
        save_model(model, tokenizer, tmp)
        st = tmp / STATE
        torch.save(optimizer.state_dict(), st / "optimizer.pt")
        torch.save(rng_state(), st / "rng.pt")
        for name, module in (extra_modules or {}).items():
            from safetensors.torch import save_model as save_module

            save_module(module, str(st / f"{name}.safetensors"))
        return {}

    return write_checkpoint(out_dir, step, own, scheduler, progress, config, plan=plan)


def save_sharded_checkpoint(out_dir: Path, step: int, model, tokenizer, optimizer, scheduler, progress: dict, config,
                            d: Dist, extra_modules: dict | None = None, plan=None) -> Path:
    """Write checkpoint-{step} from all ranks of `d` (each must call this) and return its path. `extra_modules`
    (name -> module, e.g. a reference that training updates) are saved in the shards too."""

    def own(tmp: Path) -> dict[str, str]:
        save_sharded(sharded_state(model, optimizer, extra_modules), tmp / SHARDED)
        torch.save(rng_state(), tmp / STATE / f"rng-{d.rank}.pt")
        # each rank hashes the files it wrote (the shard writer names them __RANK_N.distcp); rank 0
        # hashes the rest when it writes the manifest
        mine = [tmp / STATE / f"rng-{d.rank}.pt", *sorted((tmp / SHARDED).glob(f"__{d.rank}_*.distcp"))]
        return {str(f.relative_to(tmp)): digest for f, digest in manifest.file_digests(mine).items()}

    return write_checkpoint(out_dir, step, own, scheduler, progress, config, d, tokenizer, plan)


def save_final(out_dir: Path, model, tokenizer, state_dict: dict | None = None) -> Path:
    """Write the final model to `out_dir/final` atomically. `state_dict`: full weights gathered from shards."""

    def own(tmp: Path) -> dict[str, str]:
        save_model(model, tokenizer, tmp, state_dict)
        return {}

    return write_published(out_dir, "final", "the final model", own)
