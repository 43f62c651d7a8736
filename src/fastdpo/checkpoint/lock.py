"""The lock a run holds on its --output_dir for its lifetime (`.fastdpo.lock`): an flock the kernel drops when the
process ends however it ends, and a record of the holder (pid, host, boot, start time, command), so a second run into
the same dir stops at once, naming the first. A record left by a process that is gone (a SIGKILL, a crash, a reboot,
its pid now another program's) is taken over with a note."""

from __future__ import annotations

import errno
import json
import logging
import os
import socket
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from fastdpo.errors import FastDPOError

log = logging.getLogger("fastdpo")

LOCK = ".fastdpo.lock"


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
