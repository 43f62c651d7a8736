"""RMSNorm's kernels (`fastdpo.kernels.rms_norm`) against the float32 computation: under Triton's interpreter on the
CPU (odd widths, row counts off the block, no rows) and compiled for CUDA at the real models' widths."""

import pytest
import torch
from interpreter_helpers import interpreted, rel, run_interpreted

from fastdpo.kernels import rms_norm


def test_rms_norm_under_the_interpreter():
    run_interpreted(__file__)


def norm_reference(x, w, eps):
    xf, wf = x.float().requires_grad_(), w.float().requires_grad_()
    return xf, wf, wf * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps))


@interpreted
@pytest.mark.parametrize("width", [128, 1000, 2048])
@pytest.mark.parametrize("rows", [1, 37])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
def test_rms_norm_forward_and_backward_equal_float32(width, rows, dtype, tol):
    g = torch.Generator().manual_seed(width + rows)
    x = (torch.randn(rows, width, generator=g) * 3).to(dtype)
    w = (1 + 0.2 * torch.randn(width, generator=g)).to(dtype)
    grad = torch.randn(rows, width, generator=g).to(dtype)
    y, rstd = rms_norm.rms_norm_forward(x, w, 1e-6)
    xf, wf, want = norm_reference(x, w, 1e-6)
    want.backward(grad.float())
    assert y.dtype == dtype and y.shape == x.shape and rstd.dtype == torch.float32
    assert rel(y, want) < tol
    assert rel(rstd, torch.rsqrt(x.float().pow(2).mean(-1) + 1e-6)) < 1e-6
    dx, dw = rms_norm.rms_norm_backward(grad, x, w, rstd, weight_grad=True)
    assert dx.dtype == dtype and dw.dtype == dtype
    assert rel(dx, xf.grad) < tol and rel(dw, wf.grad) < tol
    dx2, none = rms_norm.rms_norm_backward(grad, x, w, rstd, weight_grad=False)
    assert none is None and torch.equal(dx2, dx)


@interpreted
def test_rms_norm_of_a_head_view_and_of_no_rows():
    x = torch.randn(2, 5, 3, 16)  # (batch, tokens, heads, head_dim): Qwen3's per-head norms
    w = torch.rand(16) + 0.5
    y, _ = rms_norm.rms_norm_forward(x, w, 1e-6)
    assert y.shape == x.shape and rel(y, norm_reference(x, w, 1e-6)[2]) < 1e-6
    y0, r0 = rms_norm.rms_norm_forward(torch.zeros(0, 16), w, 1e-6)
    assert y0.shape == (0, 16) and r0.shape == (0,)
    dx, dw = rms_norm.rms_norm_backward(torch.zeros(0, 16), torch.zeros(0, 16), w, r0, weight_grad=True)
    assert dx.shape == (0, 16) and torch.equal(dw, torch.zeros(16))


@pytest.mark.gpu
@pytest.mark.parametrize("width", [128, 2048, 4096, 5120])
@pytest.mark.parametrize("rows", [1, 3001])
def test_rms_norm_kernels_equal_float32(width, rows):
    g = torch.Generator(device="cuda").manual_seed(width)
    x = torch.randn(rows, width, device="cuda", generator=g).mul(3).bfloat16()
    w = (1 + 0.2 * torch.randn(width, device="cuda", generator=g)).bfloat16()
    grad = torch.randn(rows, width, device="cuda", generator=g).bfloat16()
    xf, wf = x.float().requires_grad_(), w.float().requires_grad_()
    want = wf * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6))
    want.backward(grad.float())
    y, rstd = rms_norm.rms_norm_forward(x, w, 1e-6)
    dx, dw = rms_norm.rms_norm_backward(grad, x, w, rstd, weight_grad=True)
    assert rel(y, want) < 1e-2 and rel(dx, xf.grad) < 1e-2 and rel(dw, wf.grad) < 1e-2
    plain = w * (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)).bfloat16()
    assert (y.float() - plain.float()).abs().max() <= plain.float().abs().max() * 2**-7  # eager's result but an ulp


@interpreted
@pytest.mark.parametrize("width,rows", [(128, 37), (1000, 5), (2048, 1)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_norm_quantising_its_output_gives_what_quantise_rowwise_gives(width, rows, dtype):
    """--fp8: the norm writes its output and, in the same pass, that output in e4m3 with a scale per row: bit for
    bit what `quantise_rowwise` makes of the output (a zero row too)."""
    from fastdpo.kernels.fp8 import quantise_rowwise

    g = torch.Generator().manual_seed(width)
    x = (torch.randn(rows, width, generator=g) * 3).to(dtype)
    x[0] = 0  # a row of zeros: scale of its floor, values 0
    w = (1 + 0.2 * torch.randn(width, generator=g)).to(dtype)
    y, rstd, (q, scale) = rms_norm.rms_norm_forward_fp8(x, w, 1e-6)
    y0, rstd0 = rms_norm.rms_norm_forward(x, w, 1e-6)
    assert torch.equal(y, y0) and torch.equal(rstd, rstd0)  # the norm itself unchanged
    want_q, want_scale = quantise_rowwise(y)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (rows, 1)
    assert torch.equal(scale, want_scale) and torch.equal(q.float(), want_q.float())


@pytest.mark.gpu
@pytest.mark.parametrize("width", [2048, 4096])
def test_the_norm_quantising_its_output_on_cuda_gives_the_exact_quantisation_of_it(width):
    """On CUDA: the kernel's e4m3 rows and scales are the correctly rounded quantisation of the output it wrote
    (computed here apart from fastdpo's own: the scale a float64 quotient rounded once, each value an IEEE float32
    division), and that output is the plain kernel's up to the roundings of n and n * w: the two builds may sum a
    row's squares in another order (the e4m3 stores change the layout the compiler picks), ulps apart in rstd."""
    from fp8_helpers import exact_rowwise

    g = torch.Generator(device="cuda").manual_seed(width)
    x = torch.randn(3001, width, device="cuda", generator=g).mul(3).bfloat16()
    w = (1 + 0.2 * torch.randn(width, device="cuda", generator=g)).bfloat16()
    y, rstd_fp8, (q, scale) = rms_norm.rms_norm_forward_fp8(x, w, 1e-6)
    want_q, want_scale = exact_rowwise(y)
    assert torch.equal(scale, want_scale) and torch.equal(q.float(), want_q.float())
    plain, rstd = rms_norm.rms_norm_forward(x, w, 1e-6)
    assert torch.allclose(rstd_fp8, rstd, rtol=4 * 2**-24, atol=0)
    assert torch.allclose(y.float(), plain.float(), rtol=2**-6, atol=0)  # n and then n * w each round once
    assert (y != plain).float().mean() < 0.01  # only elements at a rounding boundary move
