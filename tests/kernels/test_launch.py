"""`fastdpo.kernels.launch.launch`: the first launch of a specialisation goes through Triton's dispatch, later ones
straight to the compiled kernel's launcher with every argument in the kernel's order; anything Triton would
specialise differently (alignment, an int of 1 or a multiple of 16, a dtype, a constant) goes through Triton again.
A fake kernel stands in for Triton here; the GPU test at the end and each op's GPU tests run the real kernels
through the same path."""

import sys

import pytest
import torch
import torch.nn.functional as F
from interpreter_helpers import rel

from fastdpo.kernels import launch, rms_norm, swiglu


class FakeCompiled:
    def __init__(self, log):
        self.log, self.function, self.packed_metadata = log, "fn", "meta"

    def launch_metadata(self, grid, stream, *args):
        return ("metadata", grid)

    def run(self, gx, gy, gz, stream, function, packed, meta, enter, leave, *args):
        self.log.append(("direct", (gx, gy, gz), stream, function, packed, meta, args))


class FakeKernel:
    arg_names = ["X", "Y", "n", "eps", "BLOCK", "FLAG"]

    def __init__(self):
        self.log = []
        self.compiled = FakeCompiled(self.log)

    def __getitem__(self, grid):
        def dispatch(*args, num_warps, **constexprs):
            self.log.append(("triton", grid, args, num_warps, constexprs))
            return self.compiled

        return dispatch


@pytest.fixture
def direct(monkeypatch):
    """Direct launches on, with the CUDA lookups answered on the CPU."""
    monkeypatch.setattr(launch, "_direct_launches", lambda: True)
    monkeypatch.setattr(launch, "_compiled", {})
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 1234, raising=False)

    class Runtime:
        launch_enter_hook = launch_exit_hook = None

    monkeypatch.setattr(launch, "_knobs", type("Knobs", (), {"runtime": Runtime}))


def test_the_first_launch_goes_through_triton_and_the_next_straight_to_the_launcher(direct):
    k = FakeKernel()
    x, y = torch.zeros(64), torch.zeros(64)
    launch.launch(k, (3,), x, y, 32, 1e-6, num_warps=8, FLAG=True, BLOCK=128)
    assert [e[0] for e in k.log] == ["triton"] and k.log[0][1:] == ((3,), (x, y, 32, 1e-6), 8, {"FLAG": True, "BLOCK": 128})
    launch.launch(k, (5, 2), x, y, 48, 2e-6, num_warps=8, FLAG=True, BLOCK=128)
    kind, grid, stream, function, packed, meta, args = k.log[1]
    assert kind == "direct" and grid == (5, 2, 1) and stream == 1234 and (function, packed, meta) == ("fn", "meta", None)
    assert args[:4] == (x, y, 48, 2e-6) and args[4:] == (128, True)  # the constants in the kernel's order, not the call's


def test_what_triton_specialises_differently_goes_through_triton_again(direct):
    k = FakeKernel()
    base = torch.zeros(64)
    x, y = base[:32], torch.zeros(64)

    def go(x=x, y=y, n=32, warps=4, block=128):
        launch.launch(k, (1,), x, y, n, 1e-6, num_warps=warps, BLOCK=block, FLAG=False)

    go()
    go()
    assert [e[0] for e in k.log] == ["triton", "direct"]
    changes = [dict(x=base[1:33]), dict(x=x.double()), dict(n=1), dict(n=33), dict(n=2**31), dict(warps=8),
               dict(block=256)]
    for change in changes:
        k.log.clear()
        go(**change)
        go(**change)
        assert [e[0] for e in k.log] == ["triton", "direct"], change
    k.log.clear()
    go(n=48)  # another multiple of 16 below 2**31: the kernel that served 32
    assert [e[0] for e in k.log] == ["direct"]


def test_a_launch_whose_arguments_are_not_all_known_keeps_triton_s_dispatch(direct):
    k = FakeKernel()
    x = torch.zeros(8)
    for _ in range(2):  # FLAG left to its default: the launcher would not get it, so every launch is Triton's
        launch.launch(k, (1,), x, x, 16, 1.0, BLOCK=64)
    for _ in range(2):  # an argument kind the key does not know
        launch.launch(k, (1,), x, x, "16", 1.0, BLOCK=64, FLAG=True)
    assert [e[0] for e in k.log] == ["triton"] * 4


def test_a_profiler_s_launch_hook_gets_the_launch_s_metadata(direct):
    k = FakeKernel()
    x = torch.zeros(8)
    launch._knobs.runtime.launch_enter_hook = lambda meta: None
    for _ in range(2):
        launch.launch(k, (2,), x, x, 16, 1.0, BLOCK=64, FLAG=True)
    assert k.log[1][0] == "direct" and k.log[1][5] == ("metadata", (2,))


@pytest.mark.skipif(sys.platform != "linux", reason="Triton's wheels are Linux-only")
def test_direct_launches_follow_the_installed_triton_s_own_launch_and_stop_for_another(monkeypatch):
    import inspect

    pytest.importorskip("triton")
    monkeypatch.setattr(launch, "INTERPRET", False)
    launch._direct_launches.cache_clear()
    try:
        assert launch._direct_launches()  # this Triton's dispatch ends with the launch `launch` makes
        launch._direct_launches.cache_clear()
        monkeypatch.setattr(inspect, "getsource", lambda f: "kernel.run(grid, stream, *args)")
        assert not launch._direct_launches()
    finally:
        launch._direct_launches.cache_clear()


@pytest.mark.gpu
def test_direct_launches_serve_misaligned_views_and_other_counts_as_triton_s_dispatch_would():
    """Each kernel is compiled on its first launch for what that launch's arguments allow (16-byte aligned
    pointers, counts that are multiples of 16); later launches skip Triton's dispatch. Views at odd offsets and
    other counts, in turn with aligned ones, must still give the float32 result."""
    assert launch._direct_launches(), "this Triton's dispatch is not the one `launch.launch` repeats"
    g = torch.Generator(device="cuda").manual_seed(0)
    width = 2048
    base = torch.randn(70 * width + 8, device="cuda", generator=g).mul(2).bfloat16()
    w = (1 + 0.2 * torch.randn(width, device="cuda", generator=g)).bfloat16()
    runs = [(64, 0), (64, 0), (37, 0), (64, 3), (64, 3), (1, 5), (48, 0), (33, 1)]
    for rows, offset in runs:
        x = base[offset:offset + rows * width].view(rows, width)  # odd offsets: 2-byte aligned only
        y, _ = rms_norm.rms_norm_forward(x, w, 1e-6)
        xf = x.float()
        assert rel(y, w.float() * xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)) < 1e-2, (rows, offset)
        a, b = x.reshape(-1), base[-rows * width:]
        p = swiglu.silu_mul(a, b)
        assert rel(p, F.silu(a.float()) * b.float()) < 1e-2, (rows, offset)
    rms = rms_norm._rms_fwd
    served = [k for k in launch._compiled if k[0] is rms]
    assert any((torch.bfloat16, False) in k for k in served) and any((torch.bfloat16, True) in k for k in served)
