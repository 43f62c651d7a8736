"""Where a profiled window's device time went, phase by phase, from a `--profile_steps` trace.

    python benchmarks/trace_gaps.py RUN/profile/rank0/trace.json.gz [more traces] [--top 15] [--min_gap_us 100]

The training loop names its phases on the host (`fastdpo.pack`, `.forward`, `.loss`, `.backward`, `.metrics`,
`.clip`, `.update`); FSDP2 names its hooks (`FSDP::...`). For each trace this prints:
- per phase: its host time, and the device's compute, idle and exposed-communication time while the main thread was
  in it (time outside every phase is "(between phases)": the flag read, logging, the next step's set-up);
- the NCCL kernels by collective: count, time, and the part no compute kernel hid;
- the longest idle gaps: when, how long, the phase, and the kernel that ended the gap with the host op and the
  annotation it was launched from (a long gap before a kernel launched late is host time; before a kernel launched
  early, it is a wait on another stream).
"""

from __future__ import annotations

import argparse
import bisect
import gzip
import json
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))
from fastdpo.observe.profile import merge, subtract  # noqa: E402

DEVICE_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}


def load(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    return [e for e in events if e.get("ph") == "X" and "dur" in e]


def overlap(spans: list[tuple[float, float]], a: float, b: float) -> float:
    return sum(max(0.0, min(b, y) - max(a, x)) for x, y in spans if y > a and x < b)


def enclosing(events: list[dict], t: float, kind: str) -> str:
    """Name of the innermost event of category `kind` in `events` (one thread's, sorted by start) containing t."""
    best = None
    for e in events:
        if e["ts"] > t:
            break
        if e.get("cat") == kind and e["ts"] + e["dur"] >= t and (best is None or e["ts"] >= best["ts"]):
            best = e
    return best["name"] if best else "-"


def analyse(path: Path, top: int, min_gap_us: float) -> str:
    events = load(path)
    device = [e for e in events if e.get("cat") in DEVICE_CATS]
    if not device:
        return f"{path}: no device kernels (a CPU run?)"
    host = [e for e in events if e.get("cat") not in DEVICE_CATS and not str(e.get("cat", "")).startswith("gpu_")]
    comm = merge([(e["ts"], e["ts"] + e["dur"]) for e in device if "nccl" in e["name"].lower()])
    compute = merge([(e["ts"], e["ts"] + e["dur"]) for e in device if "nccl" not in e["name"].lower()])
    start = min(e["ts"] for e in host + device)
    end = max(e["ts"] + e["dur"] for e in device)
    busy = merge(compute + comm)
    idle = subtract([(start, end)], busy)
    exposed = subtract(comm, compute)
    phases = [e for e in host if e.get("cat") == "user_annotation" and e["name"].startswith("fastdpo.")]
    main_tid = phases[0]["tid"] if phases else None
    spans_by_phase: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for e in phases:
        spans_by_phase[e["name"]].append((e["ts"], e["ts"] + e["dur"]))
    spans_by_phase["(between phases)"] = subtract([(start, end)], merge([s for v in spans_by_phase.values() for s in v]))
    wall = end - start
    lines = [f"{path}: window {wall / 1e3:.1f} ms; compute {sum(b - a for a, b in compute) / 1e3:.1f} ms, idle "
             f"{sum(b - a for a, b in idle) / 1e3:.1f} ms, exposed communication {sum(b - a for a, b in exposed) / 1e3:.1f} ms",
             f"{'phase':<20} {'n':>4} {'host ms':>9} {'compute':>9} {'idle':>9} {'exposed':>9}"]
    for name, spans in sorted(spans_by_phase.items(), key=lambda kv: -sum(b - a for a, b in kv[1])):
        merged = merge(spans)
        t = sum(b - a for a, b in merged)
        c = sum(overlap(compute, a, b) for a, b in merged)
        i = sum(overlap(idle, a, b) for a, b in merged)
        x = sum(overlap(exposed, a, b) for a, b in merged)
        lines.append(f"{name:<20} {len(spans):>4} {t / 1e3:>9.1f} {c / 1e3:>9.1f} {i / 1e3:>9.1f} {x / 1e3:>9.1f}")
    by_coll: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0.0])
    for e in device:
        if "nccl" not in e["name"].lower():
            continue
        key = next((k for k in ("AllGather", "ReduceScatter", "AllReduce", "Broadcast", "SendRecv") if k in e["name"]),
                   e["name"][:40])
        row = by_coll[key]
        row[0] += 1
        row[1] += e["dur"]
        row[2] += sum(max(0.0, min(e["ts"] + e["dur"], b) - max(e["ts"], a)) for a, b in exposed
                      if b > e["ts"] and a < e["ts"] + e["dur"])
    lines.append(f"{'collective':<20} {'n':>4} {'ms':>9} {'exposed':>9}")
    for key, (n, t, x) in sorted(by_coll.items(), key=lambda kv: -kv[1][1]):
        lines.append(f"{key:<20} {n:>4} {t / 1e3:>9.1f} {x / 1e3:>9.1f}")
    fsdp: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for e in host:
        if e.get("cat") == "user_annotation" and e["name"].startswith("FSDP::"):
            fsdp[e["name"]][0] += 1
            fsdp[e["name"]][1] += e["dur"]
    if fsdp:
        lines.append(f"{'FSDP hook (host)':<40} {'n':>4} {'ms':>9}")
        for name, (n, t) in sorted(fsdp.items(), key=lambda kv: -kv[1][1])[:12]:
            lines.append(f"{name[:40]:<40} {n:>4} {t / 1e3:>9.1f}")
    runtime = {e["args"]["correlation"]: e for e in host
               if e.get("cat") == "cuda_runtime" and "correlation" in e.get("args", {})}
    by_tid: dict = defaultdict(list)
    for e in host:
        by_tid[e["tid"]].append(e)
    for v in by_tid.values():
        v.sort(key=lambda e: e["ts"])
    starts = sorted(device, key=lambda e: e["ts"])
    keys = [e["ts"] for e in starts]
    gaps = sorted((g for g in idle if g[1] - g[0] >= min_gap_us), key=lambda g: g[0] - g[1])[:top]
    lines.append(f"longest idle gaps (>= {min_gap_us:.0f} µs): at ms, length ms, main thread's phase, next kernel "
                 "<- host op / annotation, launched how long before it ran")
    for a, b in sorted(gaps):
        k = bisect.bisect_left(keys, b - 0.01)
        nxt = starts[k] if k < len(starts) else None
        who, note, when = "-", "", b  # the phase is the main thread's when the next kernel was launched
        if nxt is not None:
            launch = runtime.get(nxt.get("args", {}).get("correlation"))
            if launch is not None:
                when = launch["ts"]
                thread = by_tid[launch["tid"]]
                op = enclosing(thread, launch["ts"], "cpu_op")
                ann = enclosing(thread, launch["ts"], "user_annotation")
                side = "main" if launch["tid"] == main_tid else "other thread"
                who = f"{op} / {ann} ({side})"
                note = f"{(b - launch['ts']) / 1e3:.2f} ms"
        phase = next((n for n, s in spans_by_phase.items() if any(x <= when <= y for x, y in s)), "-")
        name = nxt["name"][:60] if nxt else "-"
        lines.append(f"  {(a - start) / 1e3:9.1f} {(b - a) / 1e3:7.2f}  {phase:<18} {name} <- {who} {note}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("traces", nargs="+", type=Path)
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--min_gap_us", type=float, default=100.0)
    args = ap.parse_args()
    for path in args.traces:
        print(analyse(path, args.top, args.min_gap_us))
        print()


if __name__ == "__main__":
    main()
