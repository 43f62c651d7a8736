"""The Triton kernels, interpreted on the CPU: tests/interpreted_kernels.py runs in its own process, since Triton
decides at import whether it interprets (TRITON_INTERPRET=1)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

if sys.platform != "linux":  # the test extra installs Triton on Linux, where its wheels are: there it must run
    pytest.skip("Triton's wheels are Linux-only", allow_module_level=True)


def test_the_kernels_equal_the_float32_computation_under_the_interpreter():
    here = Path(__file__).parent
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(here / "interpreted_kernels.py")],
                         env=env, capture_output=True, text=True, timeout=900, cwd=here.parent)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-3000:]
    assert " passed" in run.stdout and "skipped" not in run.stdout, run.stdout[-2000:]


def test_the_dropout_kernels_threshold_draws_p_to_the_nearest_sixteenth_bit():
    from fastdpo.model.kernels import lora_dropout_threshold

    assert lora_dropout_threshold(0.05) == 3277 and lora_dropout_threshold(0.0) == 0
    assert lora_dropout_threshold(1e-9) == 1  # a drop probability above 0 still drops
    for p in (0.01, 0.05, 0.1, 0.3, 0.5, 0.99):
        assert abs(lora_dropout_threshold(p) / 2**16 - p) <= 2**-17
