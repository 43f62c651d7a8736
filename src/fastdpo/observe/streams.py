"""Where a run's text goes when a reader goes away, and the run's own log, `output_dir/train.log`.

`fastdpo train ... 2>&1 | tee train.log`, then Ctrl-C: the whole foreground process group gets SIGINT, so `tee`
ends too and the next write to the pipe fails with EPIPE (Python ignores SIGPIPE and raises BrokenPipeError
instead; rich's console answers that with SystemExit, which would end the run before its checkpoint). A guarded
standard stream notices the failure once, points its file descriptor at /dev/null (as Python's docs on SIGPIPE
advise, so later writes and the interpreter's flush at exit succeed) and sends what is written to it on to the other
standard stream while that one is open. The run log is written with one `os.write` per line: nothing is held in a
buffer, and a signal handler may append to it while the main thread is inside a write."""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import sys
import time
from pathlib import Path

# the reader closed the pipe; the terminal went away
GONE = (errno.EPIPE, errno.EIO)


class GuardedStream:
    """`sys.stdout` or `sys.stderr` whose writes never raise once its reader is gone: the first failure points the
    descriptor at /dev/null, and this and later writes go to `other` (the other standard stream) while it is open."""

    def __init__(self, stream, other: GuardedStream | None = None):
        self.stream = stream
        self.other = other
        self.broken = False

    def _put(self, text: str) -> bool:
        if self.broken:
            return False
        try:
            self.stream.write(text)
            return True
        except OSError as e:
            if e.errno not in GONE:
                raise
            self.drop()
            return False

    def write(self, text: str) -> int:
        if not self._put(text) and self.other is not None:
            self.other._put(text)
        return len(text)

    def writelines(self, lines) -> None:
        for line in lines:
            self.write(line)

    def flush(self) -> None:
        if self.broken:
            return
        try:
            self.stream.flush()
        except OSError as e:
            if e.errno not in GONE:
                raise
            self.drop()

    def drop(self) -> None:
        """From now on the descriptor writes to /dev/null; what the failed write left in the buffer goes there too."""
        self.broken = True
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, self.stream.fileno())
            os.close(devnull)
            self.stream.flush()
        except (OSError, ValueError, AttributeError):  # no descriptor (an in-memory stream): writes are dropped here
            pass

    def __getattr__(self, name: str):  # fileno, isatty, encoding, buffer, ...: the stream's own
        return getattr(self.stream, name)


def guard_std_streams() -> tuple[GuardedStream, GuardedStream]:
    """Replace sys.stdout and sys.stderr by guarded streams that stand in for each other (once per process), and point
    the logging handlers that already write to them at the guards."""
    if isinstance(sys.stdout, GuardedStream) and isinstance(sys.stderr, GuardedStream):
        return sys.stdout, sys.stderr
    raw = {"stdout": sys.stdout, "stderr": sys.stderr}
    out, err = GuardedStream(sys.stdout), GuardedStream(sys.stderr)
    out.other, err.other = err, out
    sys.stdout, sys.stderr = out, err
    loggers = [logging.getLogger(), *logging.Logger.manager.loggerDict.values()]
    for h in (h for g in loggers for h in getattr(g, "handlers", ()) if isinstance(h, logging.StreamHandler)):
        if h.stream is raw["stdout"]:
            h.setStream(out)
        elif h.stream is raw["stderr"]:
            h.setStream(err)
    return out, err


def _descriptors() -> list[int]:
    """The standard streams' descriptors to try, stderr first, leaving out those found broken."""
    fds = []
    for name, fd in (("stderr", 2), ("stdout", 1)):
        stream = getattr(sys, name)
        if not getattr(stream, "broken", False):
            fds.append(fd)
    return fds


def say(text: str) -> None:
    """Write `text` to the first standard stream that takes it, and to every open run log, with plain `os.write`:
    safe in a signal handler, which may run while the main thread is inside a write to the same stream."""
    data = text.encode(errors="replace")
    for fd in _descriptors():
        try:
            os.write(fd, data)
            break
        except OSError:
            continue
    for handler in RunLog.open_logs:
        handler.write(f"{_now()} {text.strip()}\n")


class RunLog(logging.Handler):
    """`output_dir/train.log`: the `fastdpo` logger's records, time-stamped, one `os.write` each (appended on
    resume), so the run's story survives whatever happens to the console."""

    open_logs: list[RunLog] = []

    def __init__(self, path: Path, append: bool):
        super().__init__(logging.INFO)
        self.path = path
        flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | (0 if append else os.O_TRUNC)
        self.fd: int | None = os.open(path, flags, 0o644)
        self.setFormatter(logging.Formatter("%(asctime)s %(levelname)-8s %(message)s", "%Y-%m-%d %H:%M:%S"))

    def write(self, text: str) -> None:
        if self.fd is not None:
            try:
                os.write(self.fd, text.encode(errors="replace"))
            except OSError:  # a full disk: the log is a record, never a reason to stop
                pass

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.write(self.format(record) + "\n")
        except Exception:  # noqa: BLE001 - a log line must never stop the run
            self.handleError(record)

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        super().close()


@contextlib.contextmanager
def run_log(out: Path, append: bool, write: bool = True):
    """While active, the `fastdpo` logger also writes `out/train.log` (only where `write`: rank 0); an error that ends
    the run is recorded there too, since the console that shows it may be gone."""
    logger = logging.getLogger("fastdpo")
    handler = None
    if write:
        try:
            handler = RunLog(out / "train.log", append)
        except OSError as e:
            logger.warning("Could not open %s (%s): this run keeps no log file.", out / "train.log", e.strerror or e)
    if handler is None:
        yield
        return
    handler.write(f"{_now()} run started: {' '.join(sys.argv)}\n")
    logger.addHandler(handler)
    RunLog.open_logs.append(handler)
    try:
        yield
    except BaseException as e:
        why = "interrupted" if isinstance(e, KeyboardInterrupt) else f"{type(e).__name__}: {e}"
        handler.write(f"{_now()} run ended: {why}\n")
        raise
    finally:
        logger.removeHandler(handler)
        RunLog.open_logs.remove(handler)
        handler.close()


def _now() -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S")
