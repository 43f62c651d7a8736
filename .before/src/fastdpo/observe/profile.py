"""--profile_steps: a torch.profiler trace of a few optimizer steps, and where the device's time went.

The trace (per rank, `output_dir/profile/rank{R}/trace.json.gz`; open it in Perfetto or chrome://tracing) shows every
kernel; the summary answers the first question of a slow run without opening it: of the profiled wall time, how
much had a compute kernel running, how much only a communication (NCCL) kernel (communication not hidden behind
compute), and how much nothing at all (the device waited for the host: Python, hooks, synchronisation).
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from fastdpo.config import parse_steps

log = logging.getLogger("fastdpo")


def merge(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Sorted, non-overlapping union of [start, end) intervals."""
    out: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def length(intervals: list[tuple[float, float]]) -> float:
    return sum(end - start for start, end in intervals)


def subtract(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Parts of the merged intervals `a` not covered by the merged intervals `b`."""
    out, j = [], 0
    for start, end in a:
        cur = start
        while j < len(b) and b[j][1] <= cur:
            j += 1
        k = j
        while k < len(b) and b[k][0] < end:
            if b[k][0] > cur:
                out.append((cur, b[k][0]))
            cur = max(cur, b[k][1])
            k += 1
        if cur < end:
            out.append((cur, end))
    return out


@dataclass
class Breakdown:
    """Seconds of the profiled steps' wall time: compute kernels running (`compute_s`), only communication running
    (`exposed_comm_s`), nothing running (`idle_s`); `comm_s` is all communication kernel time, hidden or not."""

    steps: int
    wall_s: float
    compute_s: float = 0.0
    comm_s: float = 0.0
    exposed_comm_s: float = 0.0
    idle_s: float = 0.0
    top_kernels: list = field(default_factory=list)

    def line(self) -> str:
        w = max(self.wall_s, 1e-9)
        if not self.compute_s and not self.comm_s:
            return f"{self.steps} step(s) in {self.wall_s:.3f} s; no device kernels recorded (CPU run)"
        return (
            f"{self.steps} step(s) in {self.wall_s:.3f} s: compute {self.compute_s / w:.0%}, exposed "
            f"communication {self.exposed_comm_s / w:.0%} (all communication {self.comm_s:.3f} s), device idle "
            f"{self.idle_s / w:.0%}"
        )


def breakdown(events, steps: int, wall_s: float, top: int = 8) -> Breakdown:
    """Classify device events (name, start_us, duration_us) into compute and NCCL communication."""
    compute, comm, totals = [], [], {}
    for name, start, dur in events:
        (comm if "nccl" in name.lower() else compute).append((start, start + dur))
        totals[name] = totals.get(name, 0.0) + dur
    busy_compute, busy_comm = merge(compute), merge(comm)
    exposed = subtract(busy_comm, busy_compute)
    busy = length(busy_compute) + length(exposed)
    ranked = sorted(totals.items(), key=lambda kv: -kv[1])[:top]
    return Breakdown(
        steps,
        wall_s,
        length(busy_compute) / 1e6,
        length(busy_comm) / 1e6,
        length(exposed) / 1e6,
        max(wall_s - busy / 1e6, 0.0),
        [[name[:90], round(us / 1e6, 4)] for name, us in ranked],
    )


def device_events(prof) -> list[tuple[str, float, float]]:
    """(name, start µs, duration µs) of every kernel, copy and memset the profiler saw on an accelerator. User
    annotations (`record_function` ranges mirrored on the device timeline, e.g. DistributedDataParallel.forward)
    are left out: they span idle gaps and would count them as busy."""
    out = []
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CPU or getattr(e, "is_user_annotation", False):
            continue
        out.append((e.name, float(e.time_range.start), float(e.time_range.end - e.time_range.start)))
    return out


def top_ops(prof, cuda: bool, steps: int, top: int = 30) -> list[dict]:
    """The operators and kernels that took the most self time (device time on CUDA, CPU time otherwise), per step."""
    key = "self_device_time_total" if cuda else "self_cpu_time_total"
    averages = prof.key_averages()
    total = sum(getattr(e, key, 0) for e in averages) or 1
    ranked = sorted(averages, key=lambda e: getattr(e, key, 0), reverse=True)[:top]
    return [
        {
            "name": e.key,
            "calls": e.count,
            "self_ms": round(getattr(e, key, 0) / 1000 / steps, 3),
            "share": round(getattr(e, key, 0) / total, 4),
        }
        for e in ranked
    ]


def report(prof, out_dir: Path, steps: int, wall_s: float, device: torch.device, trace: str = "trace.json") -> dict:
    """Write a finished profile into `out_dir`: the Chrome trace (`trace`; a name ending in .gz is compressed),
    `top.txt` (operators by self time per step) and `summary.json` (the compute/communication/idle breakdown).
    Returns the summary."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(out / trace))
    cuda = device.type == "cuda"
    rows = top_ops(prof, cuda, steps)
    lines = [f"{'self ms/step':>12} {'share':>7} {'calls':>6}  name"]
    lines += [f"{r['self_ms']:>12.3f} {r['share']:>7.1%} {r['calls']:>6}  {r['name'][:120]}" for r in rows]
    (out / "top.txt").write_text("\n".join(lines) + "\n")
    split = breakdown(device_events(prof), steps, wall_s)
    summary = {
        "dir": str(out),
        "time": "device" if cuda else "cpu",
        "breakdown": asdict(split),
        "line": split.line(),
        "top": rows[:10],
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    return summary


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def start_profiler(device: torch.device):
    """An entered torch.profiler recording CPU ops and, on CUDA, kernels."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    synchronize(device)
    prof = profile(activities=activities, record_shapes=False)
    prof.__enter__()
    return prof


class StepProfiler:
    """Starts torch.profiler before step `first` and stops after step `last` (1-based optimizer steps), then
    writes the report into output_dir/profile/rank{R}/ and logs the breakdown. A no-op without --profile_steps.
    With `memory` (--profile_memory), the window's GPU allocations are recorded too (memtrace.py)."""

    def __init__(self, spec: str, out_dir: Path, rank: int, device: torch.device, memory: bool = False):
        from fastdpo.observe.memtrace import MemoryRecorder

        self.window = parse_steps(spec)
        self.dir, self.rank, self.device = Path(out_dir) / "profile" / f"rank{rank}", rank, device
        self.prof = None
        self.t0 = 0.0
        self.summary: dict | None = None
        self.memory = MemoryRecorder(device) if memory else None
        if self.memory is not None and not self.memory.on:
            log.warning("--profile_memory records CUDA allocations; on %s it records nothing.", device)

    def begin(self, step: int) -> None:
        if self.window is not None and step == self.window[0]:
            if self.memory is not None:
                self.memory.start()
            self.prof = start_profiler(self.device)
            self.t0 = time.perf_counter()

    def end(self, step: int) -> None:
        if self.prof is None or step != self.window[1]:
            return
        synchronize(self.device)
        wall = time.perf_counter() - self.t0
        self.prof.__exit__(None, None, None)
        self.summary = report(self.prof, self.dir, self.window[1] - self.window[0] + 1, wall, self.device, trace="trace.json.gz")
        self.prof = None
        log.info(
            "Profile of steps %d-%d (rank %d): %s. Trace and tables: %s", *self.window, self.rank, self.summary["line"], self.dir
        )
        for name, seconds in self.summary["breakdown"]["top_kernels"]:
            log.info("  %8.4f s  %s", seconds, name)
        if self.memory is not None and self.memory.on:
            log.info("Memory of steps %d-%d (rank %d; timeline: memory_snapshot.pickle on "
                     "https://pytorch.org/memory_viz):\n%s", *self.window, self.rank, self.memory.stop(self.dir))

    def close(self) -> None:
        """A run that ended inside the window: stop the profiler (and the memory recording) without a report."""
        if self.prof is not None:
            self.prof.__exit__(None, None, None)
            self.prof = None
            if self.memory is not None:
                self.memory.cancel()
