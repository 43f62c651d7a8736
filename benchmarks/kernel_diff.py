"""Device time by kernel in two profiled windows (`fastdpo bench --profile DIR` traces), and what changed between them.

    python benchmarks/kernel_diff.py BEFORE/trace.json AFTER/trace.json [--steps 2] [--top 20]

Sums each kernel's (and device copy's) durations by name in each trace, per step, and prints the names whose time
differs most, with both totals. Kernel time is what a change to the step's work moves; a window's wall time also moves
with the host, which the profiler slows.
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from trace_gaps import DEVICE_CATS, load  # noqa: E402


def kernel_times(path: Path, steps: int) -> dict[str, float]:
    """Milliseconds per step by kernel name (the first 90 characters: template arguments make names long)."""
    out: dict[str, float] = defaultdict(float)
    for e in load(path):
        if e.get("cat") in DEVICE_CATS:
            out[e["name"][:90]] += e["dur"] / 1000 / steps
    return dict(out)


def diff(before: dict[str, float], after: dict[str, float], top: int) -> list[tuple[str, float, float]]:
    names = set(before) | set(after)
    rows = [(n, before.get(n, 0.0), after.get(n, 0.0)) for n in names]
    rows.sort(key=lambda r: abs(r[2] - r[1]), reverse=True)
    return rows[:top]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("before", type=Path)
    ap.add_argument("after", type=Path)
    ap.add_argument("--steps", type=int, default=2, help="steps in each profiled window [default: 2]")
    ap.add_argument("--top", type=int, default=20)
    args = ap.parse_args(argv)
    a, b = kernel_times(args.before, args.steps), kernel_times(args.after, args.steps)
    print(f"device time per step: before {sum(a.values()):.2f} ms, after {sum(b.values()):.2f} ms, "
          f"change {sum(b.values()) - sum(a.values()):+.2f} ms")
    print(f"{'before ms':>10} {'after ms':>10} {'change':>8}  kernel")
    for name, x, y in diff(a, b, args.top):
        print(f"{x:10.3f} {y:10.3f} {y - x:+8.3f}  {name}")


if __name__ == "__main__":
    main()
