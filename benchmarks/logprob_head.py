"""Time the chunked completion log-probs (forward and backward through the head) on one GPU, with the head's gradient
summed inside the GEMM (float32 output) and with the product formed in bf16 and added, in turns.

    python benchmarks/logprob_head.py [--rows 3500] [--vocab 151936] [--hidden 2048] [--repeat 20]

Rows are a micro-batch's completion tokens (≈ 3,500 at budget 4096 on the anchor workload); the defaults are
Qwen3-1.7B's head. Prints ms per forward and backward (median over repeats) and the peak memory of each path.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))
import fastdpo.kernels.logprob_head as lp  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=3500)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--repeat", type=int, default=20)
    a = p.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    h = torch.randn(a.rows, a.hidden, device="cuda", generator=g).bfloat16().requires_grad_()
    w = (torch.randn(a.vocab, a.hidden, device="cuda", generator=g) / 32).bfloat16().requires_grad_()
    t = torch.randint(0, a.vocab, (a.rows,), device="cuda", generator=g)
    fused = lp.has_out_dtype

    def once() -> float:
        h.grad = w.grad = None
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        lp.token_logps(h, w, t).sum().backward()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end)

    paths = {"in the GEMM": fused, "bf16 product + add": lambda: False}
    times: dict[str, list[float]] = {k: [] for k in paths}
    peaks: dict[str, float] = {}
    for name, has in paths.items():  # warm-up and peak, each path alone
        lp.has_out_dtype = has
        once()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        once()
        peaks[name] = (torch.cuda.max_memory_allocated() - base) / 2**30
    for _ in range(a.repeat):
        for name, has in paths.items():
            lp.has_out_dtype = has
            times[name].append(once())
    lp.has_out_dtype = fused
    print(f"{a.rows} rows, head {a.vocab} x {a.hidden}, chunk {lp.DEFAULT_CHUNK}, {torch.cuda.get_device_name()}, "
          f"torch {torch.__version__}, GEMM with out_dtype: {fused()}")
    for name in paths:
        print(f"  {name:20s} {statistics.median(times[name]):7.2f} ms (min {min(times[name]):.2f}), "
              f"peak above inputs {peaks[name]:.2f} GiB")


if __name__ == "__main__":
    main()
