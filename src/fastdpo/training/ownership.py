"""A run owns its --output_dir. It holds a lock there for its lifetime (`.fastdpo.lock`: an flock the kernel drops
when the process ends however it ends, and a record of the holder: pid, host, boot, start time, command), so a second
run into the same dir stops at once, naming the first. A record left by a process that is gone (a SIGKILL, a crash,
a reboot, its pid now another program's) is taken over with a note. A fresh run (no --resume_from_checkpoint) into a
dir that holds another run's checkpoints, final model or metrics log is refused with the choices spelled out, or with
--overwrite_output_dir true clears those outputs first.

Runs write and delete only their own files: `.fastdpo-outputs.json` lists the names fastdpo runs created in the dir,
so a fresh run refuses to write over a file of the same name that is not on it (the --config file is never written
over), --overwrite_output_dir removes only what is on it, and a run that fails before training removes what it
created. Under torchrun rank 0 decides and the other ranks follow its decision."""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import re
import shutil
import signal
import socket
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from fastdpo.config import TrainConfig, report_targets, save_config
from fastdpo.errors import FastDPOError
from fastdpo.parallel.distributed import Dist
from fastdpo.training import checkpoint as ckpt
from fastdpo.training.setup import check_output_dir

log = logging.getLogger("fastdpo")

LOCK = ".fastdpo.lock"
# what a training run writes into its output dir (checkpoint-N/ too); --overwrite_output_dir removes these
RUN_FILES = ("metrics.jsonl", "alerts.jsonl", "config.yaml", "data_summary.json", "summary.json", "metrics.png",
             "train.log")
RUN_DIRS = ("final", "runs", "profile")
RECORD = ".fastdpo-outputs.json"  # the names fastdpo runs created in the dir: only these are ever removed
_NUMBERED = re.compile(r"^(checkpoint-\d+|metrics\.jsonl\.bak-\d+)$")
# what a start may put back or keep before training (an interrupted publish, the log trimmed for a resume): never
# removed after a failed start
_KEPT = re.compile(r"^(\.?(checkpoint-\d+|final)(\.(tmp|new|old|del))?|metrics\.jsonl\.bak-\d+)$")


# ---------------------------------------------------------------- the holder of a lock


def _proc_start(pid: int) -> int | None:
    """When process `pid` started (clock ticks since boot, Linux /proc), to tell it from a later process that got the
    same pid; -1 for a zombie (ended, not yet reaped); None where /proc cannot say."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
        return -1 if fields[0] == "Z" else int(fields[19])
    except (OSError, IndexError, ValueError):
        return None


def _boot_id() -> str:
    """This boot of the host (Linux): /proc start times are ticks since boot, comparable only within one boot."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def _cmdline(pid: int) -> str | None:
    """The command line process `pid` runs (Linux /proc), arguments joined by spaces; None where /proc cannot say."""
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return None
    return raw.rstrip(b"\0").replace(b"\0", b" ").decode("utf-8", errors="replace")


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
    boot_id: str = ""
    cmdline: str = ""  # as /proc shows it: tells the holder from a later process given its pid when start times can't

    @classmethod
    def this_process(cls) -> Holder:
        pid = os.getpid()
        return cls(pid, socket.gethostname(), time.strftime("%Y-%m-%d %H:%M:%S %z"), _command(), _proc_start(pid),
                   _boot_id(), _cmdline(pid) or "")

    @classmethod
    def parse(cls, text: str) -> Holder | None:
        try:
            d = json.loads(text)
            return cls(int(d["pid"]), str(d["host"]), str(d["started"]), str(d["command"]), d.get("proc_start"),
                       str(d.get("boot_id") or ""), str(d.get("cmdline") or ""))
        except (ValueError, KeyError, TypeError, AttributeError):
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
        boot = _boot_id()
        if self.boot_id and boot and self.boot_id != boot:
            return False  # the host restarted since: no process of the holder's boot runs
        if now is not None and self.proc_start is not None:
            return now == self.proc_start
        # no start time to compare (a record of an older fastdpo): the pid's command line says whether it is a run
        running = _cmdline(self.pid)
        if running is None:
            return True  # /proc cannot say: assume it is the holder
        return running == self.cmdline if self.cmdline else "fastdpo" in running


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
                        "without releasing it (killed, or its host restarted; its pid may now be another program's).",
                        self.out, previous.describe())
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


# ---------------------------------------------------------------- which files are a run's


def is_output_name(name: str) -> bool:
    """A name a training run writes in its output dir."""
    return name in RUN_FILES or name in RUN_DIRS or bool(_NUMBERED.match(name))


def _names(out: Path) -> set[str]:
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
    present = _names(out)
    record = _read_record(out)
    if record is None:
        checkpoints = [p for p in ckpt.numbered_checkpoints(out) if (p / ckpt.STATE / ckpt.DONE).is_file()]
        return {n for n in present if is_output_name(n)} if checkpoints else set()
    created = set(map(str, record["created"]))
    before = record.get("started_with")
    if isinstance(before, list):
        created |= {n for n in present if is_output_name(n) and n not in before}
    return created & present


def _write_record(out: Path, created: set[str], started_with: set[str] | None) -> None:
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


def _is_config_file(path: Path) -> bool:
    given = config_file()
    try:
        return given is not None and path.exists() and given.exists() and os.path.samefile(given, path)
    except OSError:
        return False


def names_written(cfg: TrainConfig, out: Path) -> list[str]:
    """The fixed names this run writes in `out` (checkpoints aside); config.yaml not when it is the --config file."""
    names = ["config.yaml", "metrics.jsonl", "alerts.jsonl", "data_summary.json", "summary.json", "train.log", "final"]
    if _is_config_file(out / "config.yaml"):
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
    present, owned = _names(out), run_outputs(out)
    return [n for n in names_written(cfg, out) if n in present and n not in owned]


def save_run_config(cfg: TrainConfig, out: Path) -> None:
    """Write output_dir/config.yaml, the resolved config, unless that file is the --config file (kept as it is;
    each checkpoint has the resolved config in state/config.yaml). From here on, a failed run keeps its outputs."""
    held = _HELD.get(str(out.resolve()))
    if held is not None:
        held.training = True
    if _is_config_file(out / "config.yaml"):
        log.info("%s is the --config file: kept as it is (the resolved config is saved in each checkpoint).",
                 out / "config.yaml")
        return
    save_config(cfg, out / "config.yaml")


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
    """Delete what fastdpo runs created in `out`, as its record says, never another file (checkpoints and final/
    first, each renamed to a hidden name before it is removed, so a kill midway leaves no half-deleted checkpoint
    under its name). Returns the names."""
    owned = run_outputs(out)
    removed = []
    for p in earlier_outputs(out):
        if p.is_dir() and p.name in owned:
            ckpt.remove_published(p)
            removed.append(p.name)
    for name in (*RUN_FILES, *sorted(n for n in owned if n.startswith("metrics.jsonl.bak-"))):
        if name in owned and (out / name).is_file() and not _is_config_file(out / name):
            (out / name).unlink()
            removed.append(name)
    for name in RUN_DIRS:
        if name == "runs" and cfg.logging_dir:  # TensorBoard's default dir only: a --logging_dir is the user's
            continue
        if name in owned and (out / name).is_dir():
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


class _Held:
    """Rank 0's hold on the dir: what was there when the run took it, and whether training began (`save_run_config`);
    until then a failure removes what the run created."""

    def __init__(self, out: Path):
        self.out = out
        self.missing = [p for p in (out, *out.parents) if not p.exists()]  # the dirs check_output_dir creates
        self.before: set[str] | None = None
        self.training = False

    def take(self) -> None:
        self.before = _names(self.out)
        _write_record(self.out, run_outputs(self.out), self.before)

    def end(self, failed: bool) -> None:
        """Record what the run created; after a failed start, remove it instead (the lock still held)."""
        if self.before is None:
            return
        if failed and not self.training:
            for name in sorted(_names(self.out) - self.before - {LOCK}):
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
            _write_record(self.out, run_outputs(self.out), None)

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
