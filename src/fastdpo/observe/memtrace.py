"""--profile_memory: record every GPU allocation over the --profile_steps window, then say what was alive at its peak
(and `peak_rss_gib` / `rss_gib`, the process's peak and current resident memory, a CPU run's memory figures).

Written per rank into `output_dir/profile/rank{R}/`: `memory_snapshot.pickle` (torch's allocator history; drop it on
https://pytorch.org/memory_viz for the timeline) and `memory.txt`, which answers the usual question without it: the
window's peak, how much of it was already allocated when the window began (weights, gradients, optimizer state,
anything kept between steps), and the rest, the allocations made inside the window and alive at the peak, grouped by
the source line that made them.
"""

from __future__ import annotations

import os
import pickle
import sys
from collections import defaultdict
from pathlib import Path

import torch

GiB = 2**30
NO_FRAME = "(no Python frame: autograd engine or C++)"


def peak_rss_gib() -> float | None:
    """This process's peak resident memory (RSS) in GiB, the memory figure of a CPU run; None where the OS cannot
    say (no `resource` module)."""
    try:
        import resource
    except ImportError:  # Windows
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return peak / (GiB if sys.platform == "darwin" else 2**20)


def rss_gib() -> float | None:
    """This process's resident memory (RSS) now, in GiB; None where the OS does not say (Linux's /proc only)."""
    try:
        with open("/proc/self/statm", encoding="ascii") as f:
            pages = int(f.read().split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return pages * os.sysconf("SC_PAGE_SIZE") / GiB


def site(frames: list[dict]) -> str:
    """Where an allocation came from: the innermost Python frame outside torch and compiled-graph files (our code,
    transformers, peft), else the innermost frame."""
    def label(f: dict) -> str:
        return f"{f.get('filename', '?')}:{f.get('line', 0)} {f.get('name', '')}".strip()

    for f in frames:
        name = f.get("filename", "")
        if name.endswith(".py") and "/torch/" not in name and "torchinductor" not in name:
            return label(f)
    return label(frames[0]) if frames else NO_FRAME


def peak_report(events: list[dict], baseline: int, top: int = 12) -> dict:
    """Replay an allocator trace (torch.cuda.memory._snapshot()['device_traces'][i]): bytes allocated follow `alloc`
    and `free_completed` events on top of `baseline` (allocated when recording began). Returns the peak, the
    baseline and the allocations alive at the peak, largest source lines first."""
    live: dict[int, dict] = {}
    now = best = 0
    at_peak: list[dict] = []
    for e in events:
        action = e.get("action")
        if action == "alloc":
            live[e["addr"]] = e
            now += e["size"]
            if now > best:
                best, at_peak = now, list(live.values())
        elif action == "free_completed" and e.get("addr") in live:
            now -= live.pop(e["addr"])["size"]
    groups: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for e in at_peak:
        g = groups[site(e.get("frames") or [])]
        g[0] += e["size"]
        g[1] += 1
    ranked = sorted(groups.items(), key=lambda kv: -kv[1][0])
    return {"peak_bytes": baseline + best, "baseline_bytes": baseline, "window_bytes_at_peak": best,
            "sites": [{"site": k, "bytes": v[0], "allocations": v[1]} for k, v in ranked[:top]],
            "other_bytes": sum(v[0] for _, v in ranked[top:])}


def format_report(r: dict) -> str:
    lines = [f"Peak in the window: {r['peak_bytes'] / GiB:.2f} GiB = {r['baseline_bytes'] / GiB:.2f} GiB allocated "
             f"before it began + {r['window_bytes_at_peak'] / GiB:.2f} GiB allocated inside it and alive at the peak:"]
    lines += [f"  {s['bytes'] / GiB:8.3f} GiB  {s['allocations']:6d} allocations  {s['site']}" for s in r["sites"]]
    if r["other_bytes"]:
        lines.append(f"  {r['other_bytes'] / GiB:8.3f} GiB  elsewhere")
    return "\n".join(lines)


class MemoryRecorder:
    """Allocator history on a CUDA device between `start` and `stop`; on other devices it records nothing."""

    def __init__(self, device: torch.device):
        self.device = device
        self.on = device.type == "cuda" and torch.cuda.is_available()
        self.baseline = 0

    def start(self) -> None:
        if not self.on:
            return
        torch.cuda.synchronize(self.device)
        self.baseline = torch.cuda.memory_allocated(self.device)
        torch.cuda.memory._record_memory_history(max_entries=2_000_000, stacks="python", device=self.device)

    def cancel(self) -> None:
        """Stop recording without a report (a run that ended inside the window)."""
        if self.on:
            torch.cuda.memory._record_memory_history(enabled=None, device=self.device)

    def stop(self, out_dir: Path) -> str | None:
        """Write memory_snapshot.pickle and memory.txt into `out_dir`; returns the report (None off CUDA)."""
        if not self.on:
            return None
        torch.cuda.synchronize(self.device)
        snap = torch.cuda.memory._snapshot(self.device)
        torch.cuda.memory._record_memory_history(enabled=None, device=self.device)
        out_dir.mkdir(parents=True, exist_ok=True)
        with open(out_dir / "memory_snapshot.pickle", "wb") as f:
            pickle.dump(snap, f)
        index = self.device.index if self.device.index is not None else torch.cuda.current_device()
        traces = snap.get("device_traces") or []
        text = format_report(peak_report(traces[index] if index < len(traces) else [], self.baseline))
        (out_dir / "memory.txt").write_text(text + "\n", encoding="utf-8")
        return text
