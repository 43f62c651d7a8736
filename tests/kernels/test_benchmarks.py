"""Each op's benchmark (benchmarks/kernels/) runs: its --smoke mode on tiny shapes, under Triton's interpreter on the
CPU (on CUDA, on the GPU), checks that the Triton op and torch agree and prints its table."""

import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks" / "kernels"
OPS = ["adamw", "fp8", "gather_rows", "logprob_head", "lora", "rms_norm", "rope", "swiglu"]
FAST = {"fp8": "fp8"}  # the name of an op's fast row in its table, where it is not Triton (FP8 runs torch._scaled_mm)

if sys.platform != "linux":  # the test extra installs Triton on Linux, where its wheels are: there it must run
    pytest.skip("Triton's wheels are Linux-only", allow_module_level=True)


def test_every_op_has_a_benchmark():
    kernels = Path(__file__).resolve().parents[2] / "src" / "fastdpo" / "kernels"
    ops = {p.stem for p in kernels.glob("*.py")} - {"__init__", "launch", "warmup"}
    assert ops == set(OPS) and all((BENCHMARKS / f"{op}.py").is_file() for op in OPS)


@pytest.mark.parametrize("op", OPS)
def test_the_benchmark_runs_in_its_smoke_mode(op):
    run = subprocess.run([sys.executable, str(BENCHMARKS / f"{op}.py"), "--smoke"], capture_output=True, text=True,
                         timeout=600, cwd=BENCHMARKS.parents[1])
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    impls = {line.split()[2] for line in run.stdout.splitlines()[2:] if len(line.split()) > 2}  # the table's rows
    assert {"torch", FAST.get(op, "triton")} <= impls, run.stdout
