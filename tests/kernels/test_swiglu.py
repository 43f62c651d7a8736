"""SwiGLU's product kernels (`fastdpo.kernels.swiglu`) against the float32 computation: under Triton's interpreter on
the CPU and compiled for CUDA; the forward rounds as eager does, and the backward's rebuilt product is the forward's."""

import pytest
import torch
import torch.nn.functional as F
from interpreter_helpers import interpreted, rel, run_interpreted

from fastdpo.kernels import swiglu


def test_swiglu_under_the_interpreter():
    run_interpreted(__file__)


@interpreted
@pytest.mark.parametrize("numel", [1, 333, 5000])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
def test_silu_mul_forward_and_backward_equal_float32(numel, dtype, tol):
    g = torch.Generator().manual_seed(numel)
    a, b, grad = (torch.randn(numel, generator=g).mul(3).to(dtype) for _ in range(3))
    af, bf = a.float().requires_grad_(), b.float().requires_grad_()
    want = F.silu(af) * bf
    want.backward(grad.float())
    p = swiglu.silu_mul(a, b)
    assert p.dtype == dtype and rel(p, want) < tol
    if dtype == torch.float32:
        assert torch.allclose(p, F.silu(a) * b, atol=1e-6)
    da, db, again = swiglu.silu_mul_backward(a, b, grad, product=True)
    assert rel(da, af.grad) < tol and rel(db, bf.grad) < tol
    assert torch.equal(again, p)  # the product rebuilt in the backward is the forward's
    assert swiglu.silu_mul_backward(a, b, grad)[2] is None


@pytest.mark.gpu
@pytest.mark.parametrize("numel", [1, 6144 * 3001 + 7])
def test_silu_mul_kernels_equal_float32(numel):
    g = torch.Generator(device="cuda").manual_seed(numel)
    a, b, grad = (torch.randn(numel, device="cuda", generator=g).mul(3).bfloat16() for _ in range(3))
    af, bf = a.float().requires_grad_(), b.float().requires_grad_()
    want = F.silu(af) * bf
    want.backward(grad.float())
    p = swiglu.silu_mul(a, b)
    assert torch.equal(p, F.silu(a) * b)  # eager's rounding exactly
    da, db, again = swiglu.silu_mul_backward(a, b, grad, product=True)
    assert rel(da, af.grad) < 1e-2 and rel(db, bf.grad) < 1e-2 and torch.equal(again, p)


@interpreted
@pytest.mark.parametrize("rows,width", [(1, 160), (7, 1000), (3, 2500)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_product_quantised_in_its_kernel_is_what_quantise_rowwise_gives(rows, width, dtype):
    """--fp8: the product written as `silu_mul` writes it and, from the same kernel, in e4m3 with a scale per row,
    bit for bit `quantise_rowwise` of it (widths past one block, a row of zeros)."""
    from fastdpo.kernels.fp8 import quantise_rowwise

    g = torch.Generator().manual_seed(rows * width)
    a, b = (torch.randn(rows, width, generator=g) * 3).to(dtype), torch.randn(rows, width, generator=g).to(dtype)
    b[0] = 0
    p, (q, scale) = swiglu.silu_mul_fp8(a, b)
    assert torch.equal(p, swiglu.silu_mul(a, b))
    want_q, want_scale = quantise_rowwise(p)
    assert scale.shape == (rows, 1) and torch.equal(scale, want_scale) and torch.equal(q.float(), want_q.float())


@pytest.mark.gpu
def test_the_product_quantised_in_its_kernel_on_cuda_is_the_exact_quantisation_of_it():
    """On CUDA: against the correctly rounded quantisation of the product, computed here apart from fastdpo's own
    (the scale a float64 quotient rounded once, each value an IEEE float32 division)."""
    from fp8_helpers import exact_rowwise

    g = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(3001, 6144, device="cuda", generator=g).mul(3).bfloat16()
    b = torch.randn(3001, 6144, device="cuda", generator=g).bfloat16()
    p, (q, scale) = swiglu.silu_mul_fp8(a, b)
    want_q, want_scale = exact_rowwise(p)
    assert torch.equal(p, swiglu.silu_mul(a, b))
    assert torch.equal(scale, want_scale) and torch.equal(q.float(), want_q.float())
