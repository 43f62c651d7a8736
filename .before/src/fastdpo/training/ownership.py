"""A run owns its --output_dir. It holds a lock there for its lifetime (`.fastdpo.lock`: an flock the kernel drops
when the process ends however it ends, and a record of the holder: pid, host, start time, command), so a second run
into the same dir stops at once, naming the first. A record left by a process that is gone (a SIGKILL, a crash) is
taken over with a note. A fresh run (no --resume_from_checkpoint) into a dir that holds another run's checkpoints,
final model or metrics log is refused with the choices spelled out, or with --overwrite_output_dir true clears
those outputs first. Under torchrun rank 0 decides and the other ranks follow its decision."""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import shutil
import signal
import socket
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from fastdpo.config import TrainConfig
from fastdpo.errors import FastDPOError
from fastdpo.parallel.distributed import Dist
from fastdpo.training import checkpoint as ckpt
from fastdpo.training.setup import check_output_dir

log = logging.getLogger("fastdpo")

LOCK = ".fastdpo.lock"
# what a training run writes into its output dir (checkpoint-N/ too); --overwrite_output_dir removes these
RUN_FILES = ("metrics.jsonl", "alerts.jsonl", "config.yaml", "data_summary.json", "summary.json", "metrics.png")
RUN_DIRS = ("final", "runs", "profile")


# ---------------------------------------------------------------- the holder of a lock


def _proc_start(pid: int) -> int | None:
    """When process `pid` started (clock ticks since boot, Linux /proc), to tell it from a later process that got the
    same pid; -1 for a zombie (ended, not yet reaped); None where /proc cannot say."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
        return -1 if fields[0] == "Z" else int(fields[19])
    except (OSError, IndexError, ValueError):
        return None


def _command() -> str:
    """This process's command line, its program by name (`fastdpo train ...`, `python -m fastdpo train ...`)."""
    if not sys.argv or not sys.argv[0]:
        return sys.executable
    prog = Path(sys.argv[0])
    name = f"python -m {prog.parent.name}" if prog.name == "__main__.py" else prog.name
    return " ".join([name, *sys.argv[1:]])


@dataclass
class Holder:
    pid: int
    host: str
    started: str
    command: str
    proc_start: int | None = None

    @classmethod
    def this_process(cls) -> Holder:
        return cls(os.getpid(), socket.gethostname(), time.strftime("%Y-%m-%d %H:%M:%S %z"), _command(),
                   _proc_start(os.getpid()))

    @classmethod
    def parse(cls, text: str) -> Holder | None:
        try:
            d = json.loads(text)
            return cls(int(d["pid"]), str(d["host"]), str(d["started"]), str(d["command"]), d.get("proc_start"))
        except (ValueError, KeyError, TypeError):
            return None

    def describe(self) -> str:
        return f"pid {self.pid} on {self.host}, started {self.started}, running `{self.command}`"

    def alive(self) -> bool | None:
        """Whether this process still runs: True / False on this host, None on another host (we cannot tell)."""
        if self.host != socket.gethostname():
            return None
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass  # it exists, under another user
        now = _proc_start(self.pid)
        if now == -1:
            return False
        return now is None or self.proc_start is None or now == self.proc_start


def _held(out: Path, holder: Holder | None, lock: Path) -> FastDPOError:
    who = holder.describe() if holder else "another process (its record is unreadable)"
    return FastDPOError(f"--output_dir {out} is in use by another run: {who}. Two runs in one dir would delete and "
                        "overwrite each other's checkpoints. Wait for it to finish or stop it, or choose another "
                        f"--output_dir. (If that process is gone, e.g. its host crashed, delete {lock}.)")


# ---------------------------------------------------------------- the lock


class OutputDirLock:
    """`acquire()` takes `out/.fastdpo.lock` or raises a FastDPOError naming its holder; `release()` gives it up.
    The flock excludes other processes wherever the filesystem supports it (local disks, NFSv4); the record names
    the holder and, on filesystems without flock, decides alone."""

    def __init__(self, out: Path):
        self.out, self.path = out, out / LOCK
        self.fd: int | None = None
        self.me = Holder.this_process()

    def acquire(self) -> None:
        try:
            import fcntl
        except ImportError:  # not POSIX: the record alone decides
            fcntl = None
        for _ in range(20):  # a holder releasing between our open and our flock: lock the file it leaves, again
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            flocked = fcntl is not None
            try:
                if fcntl is not None:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = Holder.parse(_read(fd))
                os.close(fd)
                raise _held(self.out, holder, self.path) from None
            except OSError as e:
                if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                    os.close(fd)
                    raise
                flocked = False
            try:
                same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if not same:
                os.close(fd)
                continue
            try:
                self._take(fd, flocked)
            except BaseException:
                os.close(fd)
                raise
            self.fd = fd
            return
        raise FastDPOError(f"--output_dir {self.out}: could not take {self.path} (it keeps changing). Is another run "
                           "starting there?")

    def _take(self, fd: int, flocked: bool) -> None:
        previous = Holder.parse(_read(fd))
        if previous is not None and (previous.pid, previous.host) != (self.me.pid, self.me.host):
            alive = previous.alive()
            if alive or alive is None:  # no flock on this filesystem, or a holder on another host
                raise _held(self.out, previous, self.path)
            log.warning("--output_dir %s: took over the lock of a run that is no longer running (%s); it ended "
                        "without releasing it (killed, or its host restarted).", self.out, previous.describe())
        _write(fd, json.dumps(asdict(self.me)))
        if not flocked:  # nothing excludes a process that read the record at the same moment: let the last write win
            time.sleep(0.05)
            if Holder.parse(_read(fd)) != self.me:
                raise _held(self.out, Holder.parse(_read(fd)), self.path)

    def release(self) -> None:
        if self.fd is None:
            return
        try:
            if os.fstat(self.fd).st_ino == os.stat(self.path).st_ino:
                os.unlink(self.path)  # while still holding the flock: the next run creates a fresh file
        except OSError:
            pass
        finally:
            os.close(self.fd)  # drops the flock
            self.fd = None


def _read(fd: int) -> str:
    try:
        return os.pread(fd, 1 << 16, 0).decode("utf-8", errors="replace")
    except OSError:
        return ""


def _write(fd: int, text: str) -> None:
    os.ftruncate(fd, 0)
    os.pwrite(fd, text.encode(), 0)
    os.fsync(fd)


# ---------------------------------------------------------------- outputs of an earlier run


def _metrics_steps(path: Path) -> int:
    try:
        return sum(1 for line in path.read_text(encoding="utf-8", errors="replace").splitlines() if line.strip())
    except OSError:
        return 0


def earlier_outputs(out: Path) -> list[Path]:
    """The checkpoints, final model and (non-empty) metrics log an earlier run left in `out`."""
    if not out.is_dir():
        return []
    found = ckpt.numbered_checkpoints(out)[::-1]
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


def remove_run_outputs(out: Path, cfg: TrainConfig) -> list[str]:
    """Delete what a training run writes into `out` (checkpoints and final/ first, each renamed to a hidden name
    before it is removed, so a kill midway leaves no half-deleted checkpoint under its name). Returns the names."""
    removed = []
    for p in earlier_outputs(out):
        if p.is_dir():
            ckpt.remove_published(p)
            removed.append(p.name)
    for name in RUN_FILES:
        if (out / name).is_file():
            (out / name).unlink()
            removed.append(name)
    for p in sorted(out.glob("metrics.jsonl.bak-*")):
        p.unlink()
        removed.append(p.name)
    for name in RUN_DIRS:
        if name == "runs" and cfg.logging_dir:  # TensorBoard's default dir only: a --logging_dir is the user's
            continue
        if (out / name).is_dir():
            shutil.rmtree(out / name)
            removed.append(name)
    ckpt.clean_partial(out)
    return removed


def check_earlier_run(cfg: TrainConfig, out: Path) -> None:
    """Refuse a fresh run into a dir that holds another run's outputs (or, with --overwrite_output_dir, remove
    them). A resume with `latest` that finds no checkpoint but a final model counts as fresh: there is nothing to
    continue, and it would replace that run's final model and metrics."""
    found = earlier_outputs(out)
    if cfg.resume_from_checkpoint:
        finished_only = cfg.resume_from_checkpoint == "latest" and found and not any(
            p.name.startswith("checkpoint-") for p in found) and (out / "final").is_dir()
        if not finished_only:
            if cfg.overwrite_output_dir:
                log.info("--overwrite_output_dir has no effect when resuming (--resume_from_checkpoint %s).",
                         cfg.resume_from_checkpoint)
            return
    if not found:
        return
    what = describe_outputs(found)
    if cfg.overwrite_output_dir:
        removed = remove_run_outputs(out, cfg)
        log.warning("--overwrite_output_dir: removed the earlier run's outputs from %s (%s).", out, ", ".join(removed))
        return
    lead = (f"--resume_from_checkpoint latest: {out} holds a finished run ({what}) but no checkpoint to continue "
            "from" if cfg.resume_from_checkpoint else f"--output_dir {out} holds the outputs of an earlier run ({what})")
    raise FastDPOError(
        f"{lead}. A new run there would replace its final model and metrics log, and a later --resume_from_checkpoint "
        "latest would pick up its checkpoints. Choose one: --resume_from_checkpoint latest to continue it (after "
        "raising --max_steps or --num_train_epochs, for a finished run); another --output_dir; or "
        "--overwrite_output_dir true to remove its outputs and start over."
    )


# ---------------------------------------------------------------- the run's lifetime


def decide_on_main(fn, d: Dist):
    """`fn()` on rank 0 only; every rank returns its result, or raises a FastDPOError when it failed there (the other
    ranks would otherwise wait for rank 0 in their next collective until --ddp_timeout)."""
    if d.world_size == 1:
        return fn()
    import torch.distributed as dist

    box: list = [None]
    error: BaseException | None = None
    if d.is_main:
        try:
            box = [("ok", fn())]
        except Exception as e:  # noqa: BLE001 - sent to the other ranks, then raised here as it was
            error, box = e, [("error", str(e) if isinstance(e, FastDPOError) else f"{type(e).__name__}: {e}")]
    dist.broadcast_object_list(box, src=0)
    kind, value = box[0]
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


@contextlib.contextmanager
def own_output_dir(cfg: TrainConfig, d: Dist):
    """Hold --output_dir for the body's lifetime: rank 0 takes the lock and checks for an earlier run's outputs;
    every rank follows its decision. Released on any exit."""
    out = Path(cfg.output_dir)
    lock = OutputDirLock(out)

    def take() -> None:
        check_output_dir(out)
        lock.acquire()
        try:
            check_earlier_run(cfg, out)
        except BaseException:
            lock.release()
            raise

    try:
        with _sigterm_unwinds() if d.is_main else contextlib.nullcontext():
            decide_on_main(take, d)
            yield
    finally:
        lock.release()
