"""A heartbeat across ranks that names the rank that stopped progressing (to tell a hang from an OOM).

Each rank calls `beat(step, phase)` as it reaches points of the loop (cheap: a local update). A background thread
publishes the last beat and a liveness counter to a `torch.distributed` Store (the rendezvous TCPStore, or any
TCPStore / FileStore / HashStore) every `interval` seconds, also while the main thread is blocked in a collective,
and reads every rank's record. Staleness is judged by how long a record stays unchanged on the reader's own clock,
so clocks of different hosts never need to agree. Once no rank has progressed for `stall_after` seconds (while one
still does, the others may just be waiting for it), the lowest-numbered live rank reports, once per diagnosis:

- a rank whose liveness counter stopped: its process died or froze (killed, OS OOM killer, a held GIL);
- a live rank behind the others: it stopped progressing (data loading, a deadlock, a slow disk) while the others wait
  for it in the next collective;
- every rank stalled at the same beat: a collective (NCCL) hang; run `fastdpo env` and see its NCCL advice.

Every rank that makes no progress for `stall_after` also logs its own main-thread Python stack once, so the stalled
rank shows where it is stuck and the waiting ranks show which collective they wait in.

Use with torch.distributed:

    hb = Heartbeat.for_process_group(ddp_timeout=cfg.ddp_timeout)  # None when not distributed
    with hb or contextlib.nullcontext():
        for step in ...:
            hb.beat(step, "forward") ...
"""

from __future__ import annotations

import json
import logging
import os
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable

log = logging.getLogger("fastdpo")


class Heartbeat:
    """Publish this rank's progress and watch every rank's. See the module docstring."""

    def __init__(self, store, rank: int, world_size: int, *, interval: float = 10.0, stall_after: float = 300.0,
                 dead_after: float | None = None, report: Callable[[str], None] | None = None,
                 clock: Callable[[], float] = time.monotonic, prefix: str = "fastdpo/heartbeat"):
        assert 0 <= rank < world_size and interval > 0 and stall_after > 0
        self.store, self.rank, self.world_size = store, rank, world_size
        self.interval, self.stall_after = interval, stall_after
        self.dead_after = dead_after if dead_after is not None else max(3 * interval, stall_after / 2)
        self.report = report or log.error
        self.clock, self.prefix = clock, prefix
        self.step, self.phase, self.beats, self.alive = -1, "start", 0, 0
        self.host, self.pid = socket.gethostname(), os.getpid()
        self.seen: dict[int, tuple[dict, float, float]] = {}  # rank -> (record, when beats changed, when alive changed)
        self.reported: set = set()
        self.dumped_own_stack = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._main = threading.main_thread().ident

    # ---------------------------------------------------------------- called by the training loop
    def beat(self, step: int, phase: str) -> None:
        """Record progress: step `step`, phase `phase` (e.g. forward, backward, optimizer, save)."""
        self.step, self.phase = step, phase
        self.beats += 1

    # ---------------------------------------------------------------- the watchdog
    def publish(self) -> None:
        self.alive += 1
        rec = {"step": self.step, "phase": self.phase, "beats": self.beats, "alive": self.alive, "host": self.host,
               "pid": self.pid}
        self.store.set(f"{self.prefix}/{self.rank}", json.dumps(rec))

    def read(self) -> dict[int, dict]:
        out = {}
        for r in range(self.world_size):
            key = f"{self.prefix}/{r}"
            if self.store.check([key]):  # non-blocking: `get` of a missing key would wait for it
                out[r] = json.loads(self.store.get(key))
        return out

    def check(self) -> str | None:
        """Read every rank, update staleness, and return a report if this rank should report a new stall."""
        now = self.clock()
        for r, rec in self.read().items():
            old = self.seen.get(r)
            if old is None:
                self.seen[r] = (rec, now, now)
            else:
                t_beat = old[1] if rec["beats"] == old[0]["beats"] else now
                t_alive = old[2] if rec["alive"] == old[0]["alive"] else now
                self.seen[r] = (rec, t_beat, t_alive)
        if self.rank in self.seen and now - self.seen[self.rank][1] > self.stall_after:
            self._dump_own_stack()
        stalled = {r for r, (_, tb, _) in self.seen.items() if now - tb > self.stall_after}
        if not stalled:
            self.reported.clear()
            return None
        if len(stalled) < len(self.seen):
            return None  # someone still progresses: the stalled ranks may just be waiting for it
        dead = {r for r, (_, _, ta) in self.seen.items() if now - ta > self.dead_after}
        live = [r for r in range(self.world_size) if r in self.seen and r not in dead]
        if not live or live[0] != self.rank:
            return None  # another live rank reports
        key, text = self._describe(stalled, dead, now)
        if key in self.reported:
            return None
        self.reported.add(key)
        return text

    def _where(self, r: int, now: float) -> str:
        rec, tb, _ = self.seen[r]
        return (f"rank {r} ({rec['host']} pid {rec['pid']}) last at step {rec['step']} '{rec['phase']}' "
                f"{now - tb:.0f} s ago")

    def _describe(self, stalled: set[int], dead: set[int], now: float) -> tuple[tuple, str]:
        """(what is named, for reporting each diagnosis once; the report)."""
        missing = [r for r in range(self.world_size) if r not in self.seen]
        parts = []
        beats = {r: self.seen[r][0]["beats"] for r in self.seen}
        if dead:
            key: tuple = ("dead", tuple((r, beats[r]) for r in sorted(dead)))
            parts.append("; ".join(self._where(r, now) for r in sorted(dead)) +
                         ": no heartbeat at all, so the process died or froze (killed, out of host memory, stopped); "
                         "the other ranks wait for it.")
        else:
            low = min(beats[r] for r in stalled)
            behind = sorted(r for r in stalled if beats[r] == low)
            ahead = sorted(r for r in self.seen if beats[r] > low)
            key = ("behind", tuple(behind), low)
            if ahead:
                lead = self.seen[ahead[0]][0]
                parts.append(f"{'; '.join(self._where(r, now) for r in behind)}: stopped progressing while rank(s) "
                             f"{','.join(map(str, ahead))} reached step {lead['step']} '{lead['phase']}' and wait for "
                             "it (its Python stack is in its own log).")
            elif len(stalled) == len(self.seen):
                rec, tb, _ = self.seen[behind[0]]
                parts.append(f"all {len(self.seen)} ranks stalled at step {rec['step']} '{rec['phase']}' for "
                             f"{now - tb:.0f} s: a collective (NCCL) hang. Run `fastdpo env` for the NCCL settings "
                             "that matter (NCCL_P2P_DISABLE / NCCL_IB_DISABLE) and lower --ddp_timeout to fail sooner.")
            else:
                parts.append(f"{'; '.join(self._where(r, now) for r in behind)}: stopped progressing.")
        if missing:
            parts.append(f"rank(s) {','.join(map(str, missing))} never sent a heartbeat.")
        return key, "Heartbeat: " + " ".join(parts)

    def _dump_own_stack(self) -> None:
        if self.dumped_own_stack:
            return
        self.dumped_own_stack = True
        frame = sys._current_frames().get(self._main)
        if frame is not None:
            stack = "".join(traceback.format_stack(frame))
            log.error("Heartbeat: rank %d made no progress for %.0f s (step %d '%s'); main thread stack:\n%s",
                      self.rank, self.stall_after, self.step, self.phase, stack)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.publish()
                text = self.check()
                if text:
                    self.report(text)
            except Exception as e:  # the store went away (peers exited): the watchdog must never kill training
                log.debug("heartbeat: %s", e)
            self._stop.wait(self.interval)

    def start(self) -> Heartbeat:
        self.publish()
        self._thread = threading.Thread(target=self._run, name=f"fastdpo-heartbeat-{self.rank}", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * self.interval)

    def __enter__(self) -> Heartbeat:
        return self.start() if self._thread is None else self

    def __exit__(self, *exc) -> None:
        self.stop()

    @classmethod
    def for_process_group(cls, ddp_timeout: float, interval: float = 10.0, **kw) -> Heartbeat | None:
        """A heartbeat on the default process group's rendezvous store, or None when torch.distributed is not
        initialised. It reports a stall after min(300 s, ddp_timeout / 3), well before the collective times out."""
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return None
        from torch.distributed.distributed_c10d import _get_default_store

        store = dist.PrefixStore("fastdpo", _get_default_store())
        kw.setdefault("stall_after", min(300.0, ddp_timeout / 3))
        return cls(store, dist.get_rank(), dist.get_world_size(), interval=min(interval, kw["stall_after"] / 3), **kw)
