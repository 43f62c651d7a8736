"""Triton's interpreter for the kernel tests on the CPU, and a relative error to hold kernels to float32.

Triton decides as a kernel is jitted (when its module is imported) whether it interprets (TRITON_INTERPRET=1), so
the tests that run the kernels on the CPU run in a process of their own. A test file with such tests marks them
`interpreted` (skipped in any other process) and has one test that calls `run_interpreted(__file__)`: it runs the
file's tests, its GPU ones and itself left out, in a process started with TRITON_INTERPRET=1, where they must all
pass. The same kernels compiled for CUDA are held to the same references by the files' GPU tests."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"
RUNNER = "under_the_interpreter"  # in the name of each file's test that runs the others under the interpreter

interpreted = pytest.mark.skipif(not INTERPRETING, reason="runs under Triton's interpreter, in the process the "
                                                          f"file's test_..._{RUNNER} starts")


def run_interpreted(test_file: str) -> None:
    """Run the CPU tests of `test_file` under Triton's interpreter, in a process of their own: all must pass, none
    skipped."""
    if sys.platform != "linux":  # the test extra installs Triton on Linux, where its wheels are: there it must run
        pytest.skip("Triton's wheels are Linux-only")
    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not gpu", "-k",
                          f"not {RUNNER}", test_file], env=env, capture_output=True, text=True, timeout=900, cwd=root)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-3000:]
    assert " passed" in run.stdout and "skipped" not in run.stdout, run.stdout[-2000:]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """|a - b| / |b| in float32 (Frobenius norms; |b| at least 1e-12)."""
    return ((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-12)).item()
