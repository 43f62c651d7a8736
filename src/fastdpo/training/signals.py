"""Graceful stop on SIGTERM / SIGINT (preemption, Ctrl-C): the loop finishes its optimizer step, writes a
checkpoint and exits. A second SIGINT aborts at once. A repeated SIGTERM is ignored: launchers and schedulers often
deliver it to every process of a job, and it must not cut short the checkpoint the first one asked for.

Ctrl-C under `| tee` ends `tee` as well, so the stream the run writes to may be gone by the time it stops: the notice
goes to whichever standard stream is still open and to the run log (`observe.streams.say`), and SIGPIPE stays
ignored while the handlers are active, so a write to a closed pipe fails with an error the streams absorb instead of
killing the process."""

from __future__ import annotations

import signal
import threading

from fastdpo.observe.streams import say

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class GracefulStop:
    """Context manager: while active, SIGTERM/SIGINT set `signal` (its name) instead of killing the process.

    Only the main thread can install handlers; elsewhere this is a no-op and signals keep their default action.
    """

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, object] = {}

    @property
    def requested(self) -> bool:
        return self.signum is not None

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum is not None else ""

    def _handle(self, signum: int, frame) -> None:
        if self.signum is not None:
            if signum == signal.SIGINT:
                raise KeyboardInterrupt
            return
        self.signum = signum
        # say() writes with os.write, not print/logging: a handler may run while the main thread is inside a write
        say(f"\n{signal.Signals(signum).name} received: finishing this step, then saving a checkpoint and "
            "stopping. Press Ctrl-C again to abort at once.\n")

    def install(self) -> GracefulStop:
        if threading.current_thread() is threading.main_thread() and not self._previous:
            for s in SIGNALS:
                self._previous[s] = signal.signal(s, self._handle)
            if hasattr(signal, "SIGPIPE"):  # Python's default, unless a library or an embedding program changed it
                self._previous[signal.SIGPIPE] = signal.signal(signal.SIGPIPE, signal.SIG_IGN)
        return self

    def restore(self) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous.clear()

    def __enter__(self) -> GracefulStop:
        return self.install()

    def __exit__(self, *exc) -> None:
        self.restore()

    def exit_code(self) -> int:
        """The shell's convention for a process ended by a signal: 128 + its number (130 for SIGINT, 143 SIGTERM)."""
        assert self.signum is not None
        return 128 + self.signum
