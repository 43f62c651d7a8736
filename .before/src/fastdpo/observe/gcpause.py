"""Python's cyclic garbage collector during training: its pauses measured per step, and optionally scheduled.

A collection of the oldest generation walks every tracked object in the process, and after loading a model and
compiling its layers that is hundreds of thousands of them (612k and a 407 ms pause for a 4-layer Qwen3 on a CPU,
benchmarks/NOTES.md entry 29), a pause that Python starts whenever its allocation counters say so, on each rank at
a different moment. On several GPUs a pause
on one rank stalls the others at the next collective, so the ranks' pauses add up.

`GcPauses` times every collection (through `gc.callbacks`) and reports, per logged step, the milliseconds paused
and the number of collections (`gc/pause_ms`, `gc/collections`: the largest over ranks). When training starts, the
objects that exist then (the model, compiled code, data) are frozen after one collection, so no collection during
training walks them again: Python keeps its own schedule, but a full collection walks only what training created
(on two H200s a full collection in step 9 of a Qwen3-1.7B run paused 414-510 ms without this, benchmarks/NOTES.md
entry 42). With `--gc_steps N` it also takes the schedule over: automatic collection is off, and every N steps each
rank collects the young generations (what the steps since created), at the same step, so the ranks pause together,
briefly. Survivors of those collections (compiled code of a new micro-batch length, say) are not walked again while
training runs, so cyclic garbage that outlives its step waits until training ends. Frozen objects that become
cyclic garbage during training wait too; Python's own settings come back when training ends.
"""

from __future__ import annotations

import gc
import time


class GcPauses:
    def __init__(self, every: int = 0):
        self.every = every  # 0: Python schedules its collections; N: at every N-th step end
        self._ms = 0.0
        self._count = 0
        self._began = 0.0
        self._was_enabled = True
        self._was_frozen = False
        self._running = False

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._began = time.perf_counter()
        else:
            self._ms += (time.perf_counter() - self._began) * 1e3
            self._count += 1

    def start(self) -> GcPauses:
        gc.callbacks.append(self._callback)
        self._running = True
        self._was_enabled = gc.isenabled()
        self._was_frozen = gc.get_freeze_count() > 0  # the caller's own freeze outlives training
        gc.collect()  # what setup left as garbage goes now, not frozen
        gc.freeze()
        if self.every:
            gc.disable()
        self.take()  # that collection is setup's, not a step's
        return self

    def step_end(self, step: int) -> None:
        """After optimizer step `step` (counted from 1): the scheduled collection, when one is due."""
        if self.every and step % self.every == 0:
            gc.collect(1)

    def take(self) -> dict:
        """The pauses since the last call: milliseconds in collections and their number."""
        out = {"gc/pause_ms": round(self._ms, 3), "gc/collections": self._count}
        self._ms, self._count = 0.0, 0
        return out

    def stop(self) -> None:
        if not self._running:
            return
        self._running = False
        if self._callback in gc.callbacks:
            gc.callbacks.remove(self._callback)
        if not self._was_frozen:
            gc.unfreeze()
        if self.every and self._was_enabled:
            gc.enable()
