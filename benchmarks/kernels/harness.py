"""What the kernel benchmarks share: their flags, the device they time on, timing, peak memory, the agreement check
and the table they print.

Imported first by each benchmark (before anything imports Triton): it puts the checkout's `src` on the path, and on
a machine without CUDA it switches Triton to its interpreter, so that `--smoke` runs the kernels on the CPU (tiny
shapes, one timed run: it proves the benchmark runs; its times mean nothing)."""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))
CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read as the kernels are jitted, when their modules are imported


def parse(description: str) -> argparse.Namespace:
    """The flags every benchmark takes; without CUDA only --smoke runs."""
    p = argparse.ArgumentParser(description=description.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="tiny shapes, one timed run: that it runs, not how fast "
                                                        "(on the CPU, under Triton's interpreter)")
    p.add_argument("--repeat", type=int, default=20, help="timed runs per measurement (their median is shown)")
    args = p.parse_args()
    if not CUDA and not args.smoke:
        p.error("times the kernels on a CUDA GPU; on the CPU only --smoke runs")
    if args.smoke:
        args.repeat = 1
    args.device = torch.device("cuda" if CUDA else "cpu")
    return args


def time_ms(fn, repeat: int) -> float:
    """Median milliseconds of `fn()` over `repeat` runs, after a warm-up run (which builds the kernels)."""
    fn()
    times = []
    for _ in range(repeat):
        if CUDA:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def peak_mib(fn) -> float | None:
    """Memory `fn()` allocates above what is allocated before it, at its peak, in MiB (None off CUDA)."""
    if not CUDA:
        fn()
        return None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def agree(name: str, got: torch.Tensor, want: torch.Tensor, tol: float) -> float:
    """|got - want| / |want| (float32 Frobenius norms), which must be below `tol`."""
    err = ((got.float() - want.float()).norm() / want.float().norm().clamp(min=1e-12)).item()
    if not err < tol:
        raise AssertionError(f"{name}: the Triton op and torch disagree (relative error {err:.2e}, over {tol:.0e})")
    return err


@dataclass
class Row:
    shape: str
    step: str  # fwd, bwd
    impl: str  # torch, triton
    ms: float
    rate: float  # GB/s or TFLOP/s
    peak: float | None  # MiB


GB, TFLOP = 1e9, 1e12  # the units of a row's rate: bytes moved per second, or floating-point operations


def measure(shape: str, step: str, impl: str, fn, repeat: int, work: float, unit: float) -> Row:
    """Time `fn` and take its peak memory; its rate is `work` (bytes moved, or FLOPs, per call) per second in `unit`."""
    ms = time_ms(fn, repeat)
    return Row(shape, step, impl, ms, work / (ms / 1e3) / unit if ms else 0.0, peak_mib(fn))


def print_table(title: str, rows: list[Row], unit: str) -> None:
    """The rows, with each Triton row's speed-up over the torch row of its shape and step."""
    device = torch.cuda.get_device_name() if CUDA else "CPU, Triton's interpreter (--smoke: the times mean nothing)"
    print(f"{title} on {device}, torch {torch.__version__}")
    print(f"{'shape':<16}{'step':<6}{'impl':<8}{'ms':>10}{unit:>10}{'speed-up':>10}{'peak MiB':>10}")
    torch_ms = {(r.shape, r.step): r.ms for r in rows if r.impl == "torch"}
    shapes = list(dict.fromkeys(r.shape for r in rows))
    for r in sorted(rows, key=lambda r: (shapes.index(r.shape), r.step != "fwd")):  # each shape's forwards first
        base = torch_ms.get((r.shape, r.step))
        speed = f"{base / r.ms:.2f}x" if r.impl != "torch" and base and r.ms else ""
        peak = f"{r.peak:.0f}" if r.peak is not None else "-"
        print(f"{r.shape:<16}{r.step:<6}{r.impl:<8}{r.ms:>10.3f}{r.rate:>10.1f}{speed:>10}{peak:>10}")


def _tuple(x) -> tuple:
    return x if isinstance(x, tuple) else (x,)


def fwd_bwd(shape: str, impls: dict, inputs: tuple, grads, work: tuple[float, float], unit: float, repeat: int,
            tol: float | None) -> list[Row]:
    """Rows for each implementation (name -> a function of no arguments running the op on `inputs`) of one op: its
    forward as training runs it (autograd recording) and its backward (the gradients of `inputs` for the upstream
    `grads`), with `work` = (forward's, backward's) per call. Each implementation's outputs and gradients must agree
    with the first's within `tol` (None: the caller checks agreement its own way)."""
    rows, results = [], {}
    for impl, op in impls.items():
        out = _tuple(op())

        def backward(out=out):
            return torch.autograd.grad(out, inputs, _tuple(grads), retain_graph=True)

        results[impl] = (*out, *backward())
        rows.append(measure(shape, "fwd", impl, op, repeat, work[0], unit))
        rows.append(measure(shape, "bwd", impl, backward, repeat, work[1], unit))
    first, *others = results
    for impl in others if tol is not None else ():
        for i, (got, want) in enumerate(zip(results[impl], results[first])):
            agree(f"{shape}, {impl} against {first}, result {i}", got, want, tol)
    return rows
