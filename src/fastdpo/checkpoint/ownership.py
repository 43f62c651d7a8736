"""A run owns its --output_dir (DESIGN §9): for its lifetime it holds the dir's lock (`lock`), a fresh run refuses
another run's outputs there (`overwrite`), and the run writes and deletes only its own files (`outputs`): a run that
fails before training removes what it created. Under torchrun rank 0 decides and the other ranks follow its
decision."""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import signal
import threading
from pathlib import Path

from fastdpo.checkpoint.lock import LOCK, OutputDirLock
from fastdpo.checkpoint.outputs import RECORD, is_config_file, names_in, run_outputs, write_record
from fastdpo.checkpoint.overwrite import check_earlier_run
from fastdpo.config import RunPlan, TrainConfig, save_config
from fastdpo.errors import FastDPOError
from fastdpo.parallel.distributed import Dist
from fastdpo.parallel.objects import broadcast_object

log = logging.getLogger("fastdpo")

# what a start may put back or keep before training (an interrupted publish, the log trimmed for a resume): never
# removed after a failed start
_KEPT = re.compile(r"^(\.?(checkpoint-\d+|final)(\.(tmp|new|old|del))?|metrics\.jsonl\.bak-\d+)$")


def check_output_dir(out: Path) -> None:
    """Create --output_dir and make sure this rank can write there."""
    try:
        out.mkdir(parents=True, exist_ok=True)
        # one name per rank, the same in every run: a probe a kill left behind is overwritten and removed next time
        probe = out / f".fastdpo_write_test.rank{os.environ.get('RANK', '0')}"
        probe.write_text("ok")
        probe.unlink()
    except OSError as e:
        raise FastDPOError(f"--output_dir {out} is not writable ({e.strerror}). Choose another directory.") from None


def save_run_config(cfg: TrainConfig, out: Path, plan: RunPlan | None = None) -> None:
    """Write output_dir/config.yaml, the config as given (defaults filled in), unless that file is the --config file
    (kept as it is; each checkpoint has the config in state/config.yaml), and output_dir/plan.json, what set-up
    resolved from it. From here on, a failed run keeps its outputs."""
    held = _HELD.get(str(out.resolve()))
    if held is not None:
        held.training = True
    if plan is not None:
        plan.save(out)
    if is_config_file(out / "config.yaml"):
        log.info("%s is the --config file: kept as it is (the resolved config is saved in each checkpoint).",
                 out / "config.yaml")
        return
    save_config(cfg, out / "config.yaml")


# ---------------------------------------------------------------- the run's lifetime


def decide_on_main(fn, d: Dist):
    """`fn()` on rank 0 only; every rank returns its result, or raises a FastDPOError when it failed there (the other
    ranks would otherwise wait for rank 0 in their next collective until --ddp_timeout)."""
    if d.world_size == 1:
        return fn()
    answer = None
    error: BaseException | None = None
    if d.is_main:
        try:
            answer = ("ok", fn())
        except Exception as e:  # noqa: BLE001 - sent to the other ranks, then raised here as it was
            error, answer = e, ("error", str(e) if isinstance(e, FastDPOError) else f"{type(e).__name__}: {e}")
    kind, value = broadcast_object(answer, d)
    if kind == "ok":
        return value
    if error is not None:
        raise error
    raise FastDPOError(f"rank 0 stopped the run: {value}")


@contextlib.contextmanager
def _sigterm_unwinds():
    """While the lock is held outside the training loop (whose own handler finishes the step and checkpoints),
    SIGTERM raises SystemExit(143) instead of ending the process at once, so the lock is released on the way out."""
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGTERM) != signal.SIG_DFL:
        yield
        return

    def handler(signum, frame):
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


class _Held:
    """Rank 0's hold on the dir: what was there when the run took it, and whether training began (`save_run_config`);
    until then a failure removes what the run created."""

    def __init__(self, out: Path):
        self.out = out
        self.missing = [p for p in (out, *out.parents) if not p.exists()]  # the dirs check_output_dir creates
        self.before: set[str] | None = None
        self.training = False

    def take(self) -> None:
        self.before = names_in(self.out)
        write_record(self.out, run_outputs(self.out), self.before)

    def end(self, failed: bool) -> None:
        """Record what the run created; after a failed start, remove it instead (the lock still held)."""
        if self.before is None:
            return
        if failed and not self.training:
            for name in sorted(names_in(self.out) - self.before - {LOCK}):
                if _KEPT.match(name):
                    continue
                p = self.out / name
                if p.is_dir() and not p.is_symlink():
                    shutil.rmtree(p, ignore_errors=True)
                else:
                    p.unlink(missing_ok=True)
            if RECORD not in self.before:
                return
        with contextlib.suppress(OSError):
            write_record(self.out, run_outputs(self.out), None)

    def remove_created_dirs(self) -> None:
        """After a failed start, once the lock is gone: the dirs it created, each only while empty (another run may
        have begun there since)."""
        for p in self.missing:
            try:
                p.rmdir()
            except OSError:
                return


_HELD: dict[str, _Held] = {}  # output dirs this process holds, by resolved path


@contextlib.contextmanager
def own_output_dir(cfg: TrainConfig, d: Dist):
    """Hold --output_dir for the body's lifetime: rank 0 takes the lock and checks for an earlier run's outputs;
    every rank follows its decision. Released on any exit; a run that fails before training (`save_run_config`)
    leaves no file or dir it created."""
    out = Path(cfg.output_dir)
    lock = OutputDirLock(out)
    held = _Held(out)
    key = str(out.resolve())

    def take() -> None:
        check_output_dir(out)
        lock.acquire()
        try:
            check_earlier_run(cfg, out)
            held.take()
        except BaseException:
            lock.release()
            held.remove_created_dirs()
            raise
        _HELD[key] = held

    failed = True
    try:
        with _sigterm_unwinds() if d.is_main else contextlib.nullcontext():
            decide_on_main(take, d)
            yield
        failed = False
    finally:
        if _HELD.get(key) is held:
            del _HELD[key]
            held.end(failed)
        lock.release()
        if failed and not held.training and held.before is not None:
            held.remove_created_dirs()
