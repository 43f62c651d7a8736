"""The FP8 linear (`fastdpo.kernels.fp8`): row-wise e4m3 quantisation, and the Function's output and input gradient
against a float32 computation of the same quantised math (tight) and against the unquantised product (loose: the
bound e4m3's three mantissa bits allow). On the CPU the emulated path runs; the `_scaled_mm` path is checked against
it in tests/kernels/test_fp8_gpu.py. The row-wise quantisation's Triton kernel runs under Triton's interpreter here
(the file's tests run again in a process of their own with TRITON_INTERPRET=1, where `quantise_rowwise` takes the
kernel)."""

import pytest
import torch
from fp8_helpers import exact_rowwise
from interpreter_helpers import interpreted, run_interpreted

from fastdpo.kernels.fp8 import (
    E4M3,
    E4M3_MAX,
    Fp8LinearFunction,
    dequantise,
    fp8_matmul,
    quantise_rowwise,
    scaled_mm_serves,
)

# e4m3 keeps 3 mantissa bits: one rounding is within 2**-4 relative (half a unit in the last place), a few percent
# in norm over a row. Two quantised operands: the product's relative error (Frobenius norm) on Gaussian data is about
# 3.5 %; 6 % bounds it with room, while a wrong scale or a transposed operand gives errors of order 1.
FP8_BOUND = 0.06


def test_fp8_under_the_interpreter():
    run_interpreted(__file__)


@interpreted
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows,width", [(1, 16), (37, 1000), (5, 2048), (0, 64)])
@pytest.mark.parametrize("columns", [False, True])
def test_the_quantising_kernel_gives_the_eager_quantisation_bit_for_bit(dtype, rows, width, columns, monkeypatch):
    """The kernel (one row per program, widths off its block, a row of zeros, magnitudes over twelve decades,
    with and without column scales) against eager torch's `_quantise` and the independent exact quantisation."""
    from fastdpo.kernels import fp8

    launched = []
    real = fp8.launch
    monkeypatch.setattr(fp8, "launch", lambda kernel, *a, **k: launched.append(kernel) or real(kernel, *a, **k))
    g = torch.Generator().manual_seed(rows + width)
    x = torch.randn(rows, width, generator=g) * torch.logspace(-6, 6, max(rows, 1))[:rows, None]
    if rows > 1:
        x[1] = 0
    x = x.to(dtype)
    col = (torch.rand(1, width, generator=g) + 0.5) if columns else None
    q, scale = quantise_rowwise(x, col_scale=col)
    want_q, want_scale = fp8._quantise(x, col, E4M3)
    assert q.dtype == E4M3 and q.shape == (rows, width) and scale.shape == (rows, 1)
    assert torch.equal(scale, want_scale) and torch.equal(q.float(), want_q.float())
    if not columns:
        exact_q, exact_scale = exact_rowwise(x)
        assert torch.equal(scale, exact_scale) and torch.equal(q.float(), exact_q.float())
    assert launched == ([fp8._quantise_rows] if rows else [])


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def test_quantise_rowwise_scales_each_row_by_its_absolute_maximum():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 33, generator=g) * torch.tensor([1e-3, 1.0, 50.0, 1e4, 0.0])[:, None]
    q, scale = quantise_rowwise(x)
    assert q.dtype == E4M3 and q.shape == x.shape and scale.shape == (5, 1) and scale.dtype == torch.float32
    amax = x.abs().amax(1, keepdim=True)
    torch.testing.assert_close(scale[:4], amax[:4] / E4M3_MAX)  # the row's largest element maps to 448
    assert torch.equal(q[:4].float().abs().amax(1), torch.full((4,), E4M3_MAX))
    assert torch.equal(q[4].float(), torch.zeros(33))  # a row of zeros stays zeros (no 0/0)
    # the round trip: each element within half an e4m3 step of its row's scale (2**-4 relative, plus subnormals)
    back = dequantise(q, scale)
    err = (back - x).abs()
    assert (err <= x.abs() * 2**-4 + scale * 2**-9 + 1e-30).all()
    assert rel(back[:4], x[:4]) < 0.04
    # the cast is e4m3's round to nearest of x / scale
    assert torch.equal(q, (x / scale).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3))
    # bit for bit the correctly rounded quantisation (the fused kernels' rule) on many rows of any magnitude
    y = torch.randn(4001, 64, generator=g) * torch.logspace(-6, 6, 4001).unsqueeze(1)
    want_q, want_scale = exact_rowwise(y)
    q, scale = quantise_rowwise(y)
    assert torch.equal(scale, want_scale) and torch.equal(q.float(), want_q.float())


def test_a_column_scale_is_applied_before_the_row_quantisation():
    g = torch.Generator().manual_seed(5)
    x, cols = torch.randn(6, 32, generator=g), torch.rand(1, 32, generator=g) + 0.01
    q, scale = quantise_rowwise(x, col_scale=cols)
    want_q, want_scale = quantise_rowwise(x * cols)
    assert torch.equal(q, want_q) and torch.equal(scale, want_scale)
    assert not torch.equal(q, quantise_rowwise(x)[0])


def emulated_reference(x, wq, w_scale, g):
    """The same quantised math written out in float32: x quantised per row, times the dequantised weight; x's gradient
    from g scaled by the weight's row scales, quantised per row, times the FP8 weight."""
    fmax = E4M3_MAX
    xs = x.abs().amax(1, keepdim=True).clamp(min=1e-12) / fmax
    xq = (x / xs).clamp(-fmax, fmax).to(E4M3).float() * xs
    y = xq @ (wq.float() * w_scale).t()
    gw = g * w_scale.t()
    gs = gw.abs().amax(1, keepdim=True).clamp(min=1e-12) / fmax
    gq = (gw / gs).clamp(-fmax, fmax).to(E4M3).float() * gs
    return y, gq @ wq.float()


@pytest.mark.parametrize("m,k,n,bias", [(7, 24, 40, False), (33, 64, 48, True), (1, 16, 16, False)])
def test_fp8_linear_matches_the_same_quantised_math_in_float32(m, k, n, bias):
    """Shapes not multiples of 16 too (k 24, n 40): the emulation serves every shape."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(m, k, generator=g).requires_grad_()
    w = torch.randn(n, k, generator=g) / k**0.5
    b = torch.randn(n, generator=g) if bias else None
    wq, w_scale = quantise_rowwise(w)
    y = Fp8LinearFunction.apply(x, wq, w_scale, b)
    up = torch.randn(m, n, generator=g)
    (gx,) = torch.autograd.grad(y, x, up)
    want_y, want_gx = emulated_reference(x.detach(), wq, w_scale, up)
    if bias:
        want_y = want_y + b
    torch.testing.assert_close(y, want_y, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(gx, want_gx, rtol=1e-5, atol=1e-6)
    # against the unquantised product: within FP8's bound, and not exact (the quantisation is really there)
    exact_y, exact_gx = x.detach() @ w.t() + (b if bias else 0), up @ w
    assert 1e-4 < rel(y, exact_y) < FP8_BOUND
    assert 1e-4 < rel(gx, exact_gx) < FP8_BOUND


def test_fp8_linear_in_bfloat16_gives_bfloat16_and_keeps_no_activation():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(9, 32, generator=g).bfloat16().requires_grad_()
    w = torch.randn(48, 32, generator=g)
    wq, w_scale = quantise_rowwise(w)
    y = Fp8LinearFunction.apply(x, wq, w_scale, None)
    assert y.dtype == torch.bfloat16
    saved = {t.data_ptr() for t in y.grad_fn.saved_tensors}
    assert x.data_ptr() not in saved and saved == {wq.data_ptr(), w_scale.data_ptr()}
    (gx,) = torch.autograd.grad(y.float().sum(), x)
    assert gx.dtype == torch.bfloat16 and rel(gx, torch.ones(9, 48) @ w) < FP8_BOUND


def test_the_weight_gets_no_gradient_and_the_bias_its_own():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4, 16, generator=g, requires_grad=True)
    wq, w_scale = quantise_rowwise(torch.randn(16, 16, generator=g))
    b = torch.zeros(16, requires_grad=True)
    y = Fp8LinearFunction.apply(x, wq, w_scale, b)
    up = torch.randn(4, 16, generator=g)
    y.backward(up)
    torch.testing.assert_close(b.grad, up.sum(0))


def test_the_emulation_serves_off_cuda():
    q, s = quantise_rowwise(torch.randn(4, 16))
    assert not scaled_mm_serves(q, q, torch.bfloat16)
    # emulated: (a * sa) @ (b * sb)^T exactly as float32 math
    got = fp8_matmul(q, s, q, s, torch.float32)
    torch.testing.assert_close(got, dequantise(q, s) @ dequantise(q, s).t())
