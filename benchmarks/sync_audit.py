"""Every place where a `fastdpo train` run makes the host wait for the GPU, with how often.

    python benchmarks/sync_audit.py TRAIN_FLAGS...      (one GPU; e.g. --model DIR --dataset FILE --max_steps 4)

Runs the trainer with CUDA's sync debug mode set to warn, and counts each synchronizing call by its fastdpo call
stack (the innermost frames), prefixed by the line outside fastdpo that synchronised, if any. A site met once per
micro-batch stalls the host's run-ahead (and, under FSDP2, its prefetching) every micro-step; a site met once per
step costs one stall per step; setup sites (loading, the reference precompute) cost nothing per step. Prints the
table at exit, busiest first.
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
    stack = [f for f in traceback.extract_stack()[:-1]
             if not f.filename.endswith(("warnings.py", "sync_audit.py")) and "<frozen" not in f.filename]
    ours = [f for f in stack if "/fastdpo/" in f.filename]
    site = " <- ".join(f"{f.filename.rsplit('/fastdpo/', 1)[-1]}:{f.lineno} {f.name}" for f in ours[::-1][:FRAMES])
    inner = stack[-1] if stack else None  # the line that synchronised, when it is not ours (torch, transformers)
    if inner is not None and "/fastdpo/" not in inner.filename:
        where = inner.filename.rsplit("site-packages/", 1)[-1]
        site = f"[{where}:{inner.lineno} {inner.name}] " + site
    counts[site or f"(no Python frame) {filename}:{lineno}"] += 1


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
