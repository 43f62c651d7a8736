"""The rotary embedding's kernel (`fastdpo.kernels.rope`) against the float32 rotation, forward and backward: under
Triton's interpreter on the CPU (odd head sizes, a per-batch cos, no tokens) and compiled for CUDA at the real
models' head sizes."""

import pytest
import torch
from interpreter_helpers import interpreted, rel, run_interpreted

from fastdpo.kernels import rope


def test_rope_under_the_interpreter():
    run_interpreted(__file__)


def rope_reference(x, cos, sin):
    half = x.shape[-1] // 2
    return x * cos[:, None] + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin[:, None]


@interpreted
@pytest.mark.parametrize("batch,tokens,heads,head_dim,cos_batch", [(1, 37, 3, 16, 1), (2, 5, 2, 12, 2),
                                                                   (2, 19, 1, 128, 1)])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
def test_rope_forward_and_backward_equal_float32(batch, tokens, heads, head_dim, cos_batch, dtype, tol):
    g = torch.Generator().manual_seed(tokens * heads + head_dim)
    x = torch.randn(batch, tokens, heads, head_dim, generator=g).to(dtype).transpose(1, 2)  # the projections' layout
    angles = torch.randn(cos_batch, tokens, head_dim // 2, generator=g).mul(3).repeat(1, 1, 2)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    grad = torch.randn(batch, heads, tokens, head_dim, generator=g).to(dtype)
    xf = x.float().requires_grad_()
    want = rope_reference(xf, cos.float(), sin.float())
    want.backward(grad.float())
    y = rope.rope(x, cos, sin)
    assert y.dtype == dtype and y.shape == x.shape and rel(y, want) < tol
    assert y.transpose(1, 2).is_contiguous()  # laid out as (B, S, H, D), as the attention reads it
    dx = rope.rope(grad, cos, sin, backward=True)
    assert dx.shape == x.shape and rel(dx, xf.grad) < tol
    assert rope.rope(x[:, :, :0], cos[:, :0], sin[:, :0]).shape == (batch, heads, 0, head_dim)


@pytest.mark.gpu
@pytest.mark.parametrize("heads,head_dim", [(16, 128), (8, 128), (32, 64)])
@pytest.mark.parametrize("tokens", [1, 3001])
def test_rope_kernels_equal_float32(heads, head_dim, tokens):
    g = torch.Generator(device="cuda").manual_seed(tokens + heads)
    x = torch.randn(1, tokens, heads, head_dim, device="cuda", generator=g).bfloat16().transpose(1, 2)
    angles = torch.rand(1, tokens, head_dim // 2, device="cuda", generator=g).mul(50).repeat(1, 1, 2)
    cos, sin = angles.cos().bfloat16(), angles.sin().bfloat16()
    grad = torch.randn(1, tokens, heads, head_dim, device="cuda", generator=g).bfloat16().transpose(1, 2)
    xf = x.float().requires_grad_()
    half = head_dim // 2
    want = xf * cos.float()[:, None] + torch.cat((-xf[..., half:], xf[..., :half]), -1) * sin.float()[:, None]
    want.backward(grad.float())
    y, dx = rope.rope(x, cos, sin), rope.rope(grad, cos, sin, backward=True)
    assert rel(y, want) < 1e-2 and rel(dx, xf.grad) < 1e-2 and y.transpose(1, 2).is_contiguous()
