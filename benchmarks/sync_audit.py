"""Every place where a `fastdpo train` run makes the host wait for the GPU, with how often.

    python benchmarks/sync_audit.py TRAIN_FLAGS...      (one GPU; e.g. --model DIR --dataset FILE --max_steps 4)

Runs the trainer with CUDA's sync debug mode set to warn, and counts each synchronizing call by its fastdpo call
stack (the innermost frames). A site met once per micro-batch stalls the host's run-ahead (and, under FSDP2, its
prefetching) every micro-step; a site met once per step costs one stall per step; setup sites (loading, the
reference precompute) cost nothing per step. Prints the table at exit, busiest first.
"""

from __future__ import annotations

import collections
import sys
import traceback
import warnings

import torch

from fastdpo.cli import main

FRAMES = 4  # innermost fastdpo frames that name a site
counts: collections.Counter = collections.Counter()
shown = warnings.showwarning


def _count(message, category, filename, lineno, file=None, line=None):
    if "synchroniz" not in str(message):
        return shown(message, category, filename, lineno, file, line)
    ours = [f for f in traceback.extract_stack()[:-1] if "/fastdpo/" in f.filename]
    site = " <- ".join(f"{f.filename.rsplit('/fastdpo/', 1)[-1]}:{f.lineno} {f.name}" for f in ours[::-1][:FRAMES])
    counts[site or f"(outside fastdpo) {filename}:{lineno}"] += 1


def report() -> None:
    print(f"\nsynchronizing calls: {sum(counts.values())} at {len(counts)} sites")
    for site, n in counts.most_common():
        print(f"{n:7d}  {site}")


if __name__ == "__main__":
    warnings.showwarning = _count
    warnings.simplefilter("always")
    torch.cuda.set_sync_debug_mode("warn")
    try:
        code = main(["train", *sys.argv[1:]])
    finally:
        torch.cuda.set_sync_debug_mode("default")
        report()
    sys.exit(code)
