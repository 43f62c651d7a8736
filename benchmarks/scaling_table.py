"""The table of a `scaling_profile.sh` call: each run's time over a window of steps, and its per-GPU rate against
the one-GPU run of its budget from the same call.

    python benchmarks/scaling_table.py LOGS_DIR --pairs 32 [--gpus 2] [--first 3] [--last 9]

LOGS_DIR holds `<run>.metrics.jsonl` files named as the script names its runs (`1gpu_4096`, `before_1gpu_4096`,
`full_shard_4096`, `before_ddp_8192_r2`, ...). A run's time is the sum of pairs / (pairs/s) over steps FIRST..LAST
(the steps every run has after warm-up, before the profiled last one); a run missing some of them is listed as
incomplete instead of being compared. Per GPU = one GPU's time / (GPUS × the run's time), against the current
code's `1gpu_<budget>` for every tree (a `before_1gpu_<budget>` run is listed, to show one GPU unchanged).
Repeats (`_r2`, `_r3`...) get a row each and a mean row. "padding": the window's mean `batch/padding` (token
positions the busiest rank ran beyond the pairs' own, times the ranks), where the run logged it. Prints Markdown.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path

NAME = re.compile(r"^(?P<base>.+?_(?P<budget>\d+))(?:_r(?P<rep>\d+))?$")


def window_seconds(path: Path, pairs: int, first: int, last: int) -> tuple[float | None, float, float | None]:
    """(seconds over steps first..last, or None when one is missing; the peak GiB seen; the window's mean
    batch/padding, or None when not logged)."""
    rows = [json.loads(line) for line in open(path, encoding="utf-8") if line.strip()]
    steps = {r["step"]: r for r in rows if "pairs_per_second" in r and "step" in r}
    peak = max((r.get("memory/peak_gib", 0.0) for r in rows), default=0.0)
    if any(s not in steps or not steps[s]["pairs_per_second"] for s in range(first, last + 1)):
        return None, peak, None
    padding = [steps[s]["batch/padding"] for s in range(first, last + 1) if "batch/padding" in steps[s]]
    return (sum(pairs / steps[s]["pairs_per_second"] for s in range(first, last + 1)), peak,
            statistics.mean(padding) if padding else None)


def table(logs: Path, pairs: int, gpus: int, first: int, last: int) -> list[str]:
    times: dict[str, float] = {}
    peaks: dict[str, float] = {}
    pads: dict[str, str] = {}
    incomplete = []
    for path in sorted(logs.glob("*.metrics.jsonl")):
        name = path.name[: -len(".metrics.jsonl")]
        secs, peak, padding = window_seconds(path, pairs, first, last)
        if secs is None:
            incomplete.append(name)
            continue
        times[name], peaks[name] = secs, peak
        pads[name] = "–" if padding is None else f"{100 * padding:.1f} %"
    out = [f"| run | steps {first}–{last} | per GPU vs one GPU | peak GiB | padding |", "|---|---|---|---|---|"]
    groups: dict[str, list[str]] = {}
    for name in times:
        m = NAME.match(name)
        groups.setdefault(m.group("base") if m else name, []).append(name)
    for base in sorted(groups, key=lambda b: ("1gpu" not in b, b)):
        rates = []
        for name in sorted(groups[base]):
            m = NAME.match(name)
            one = times.get(f"1gpu_{m.group('budget')}") if m else None
            if "1gpu" in name or one is None:
                out.append(f"| {name} | {times[name]:.3f} s | – | {peaks[name]:.2f} | {pads[name]} |")
                continue
            rates.append(one / (gpus * times[name]))
            out.append(f"| {name} | {times[name]:.3f} s | {100 * rates[-1]:.1f} % | {peaks[name]:.2f} | {pads[name]} |")
        if len(groups[base]) > 1:
            mean = statistics.mean(times[n] for n in groups[base])
            rate = f"{100 * statistics.mean(rates):.1f} %" if rates else "–"
            out.append(f"| {base} (mean of {len(groups[base])}) | {mean:.3f} s | {rate} | | |")
    out += [f"| {name} | incomplete: steps {first}–{last} not all logged | – | – | – |" for name in incomplete]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("logs", type=Path)
    ap.add_argument("--pairs", type=int, required=True, help="pairs per optimizer step (GLOBAL)")
    ap.add_argument("--gpus", type=int, default=2)
    ap.add_argument("--first", type=int, default=3)
    ap.add_argument("--last", type=int, default=9)
    a = ap.parse_args(argv)
    if not a.logs.is_dir():
        print(f"scaling_table: {a.logs} is not a directory of <run>.metrics.jsonl files", file=sys.stderr)
        return 2
    print("\n".join(table(a.logs, a.pairs, a.gpus, a.first, a.last)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
