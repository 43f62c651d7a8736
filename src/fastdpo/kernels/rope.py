"""Rotary embeddings, x * cos + rotate_half(x) * sin for the queries and keys of every head, as one kernel each way.

Eager torch rotates with a slice, a negation, a concatenation, two products and a sum per tensor, and autograd keeps
what they need. The kernel reads x in the projections' layout and writes the rotation once (float32 arithmetic,
rounded once); `RopeFunction` keeps only cos and sin, since the backward is the rotation's transpose. Which calls it
serves (the standard rotation inside a fused attention) is decided in `fastdpo.model.fused`."""

from __future__ import annotations

import torch

from fastdpo.kernels.launch import HAVE_TRITON, cdiv, launch, next_power_of_2

if HAVE_TRITON:  # else no kernel: the modeling module's own rotation serves
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["T", "S", "H", "sx_b", "sc_b"])
    def _rope(X, C, SN, Y, T, S, H, sx_b, sx_s, sx_h, sc_b, sc_s, HALF: tl.constexpr, BLOCK_T: tl.constexpr,
              BLOCK_D: tl.constexpr, BACKWARD: tl.constexpr):
        """Rotate half of every head: forward y = x * cos + rotate_half(x) * sin, backward its transpose (the gradient
        rotated by -sin). X is (B, S, H, D) through its strides (D contiguous), C and SN are (B or 1, S, D); Y is
        contiguous (B, S, H, D). Tokens index B * S."""
        tok = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        d = tl.arange(0, BLOCK_D)
        tmask = tok < T
        mask = tmask[:, None] & (d < HALF)[None, :]
        b = (tok // S).to(tl.int64)
        s = (tok % S).to(tl.int64)
        c_off = (b * sc_b + s * sc_s)[:, None] + d[None, :]
        c1 = tl.load(C + c_off, mask=mask, other=0.0).to(tl.float32)
        c2 = tl.load(C + c_off + HALF, mask=mask, other=0.0).to(tl.float32)
        s1 = tl.load(SN + c_off, mask=mask, other=0.0).to(tl.float32)
        s2 = tl.load(SN + c_off + HALF, mask=mask, other=0.0).to(tl.float32)
        x_base = (b * sx_b + s * sx_s)[:, None] + d[None, :]
        y_base = tok.to(tl.int64)[:, None] * (H * 2 * HALF) + d[None, :]
        for h in range(H):
            x1 = tl.load(X + x_base + h * sx_h, mask=mask, other=0.0).to(tl.float32)
            x2 = tl.load(X + x_base + h * sx_h + HALF, mask=mask, other=0.0).to(tl.float32)
            if BACKWARD:
                y1 = x1 * c1 + x2 * s2
                y2 = x2 * c2 - x1 * s1
            else:
                y1 = x1 * c1 - x2 * s1
                y2 = x2 * c2 + x1 * s2
            tl.store(Y + y_base + h * (2 * HALF), y1.to(Y.dtype.element_ty), mask=mask)
            tl.store(Y + y_base + h * (2 * HALF) + HALF, y2.to(Y.dtype.element_ty), mask=mask)


ROPE_TOKENS = 16


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backward: bool = False) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin for x of shape (B, H, S, D) (any strides, D contiguous) and cos, sin of shape
    (B or 1, S, D), in float32 and rounded once; with `backward`, the gradient's rotation back (by -sin). The result
    is laid out as (B, S, H, D) and returned transposed to (B, H, S, D), the layout the projections give."""
    b, h, s, d = x.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    cos, sin = cos.expand(-1, s, d), sin.expand(-1, s, d)
    if cos.stride(-1) != 1 or sin.stride() != cos.stride():
        cos, sin = cos.contiguous(), sin.contiguous()
    y = torch.empty((b, s, h, d), dtype=x.dtype, device=x.device)
    t = b * s
    if t:
        launch(_rope, (cdiv(t, ROPE_TOKENS),), x, cos, sin, y, t, s, h, x.stride(0), x.stride(2), x.stride(1),
               cos.stride(0) if cos.shape[0] > 1 else 0, cos.stride(1), num_warps=4, HALF=d // 2, BLOCK_T=ROPE_TOKENS,
               BLOCK_D=next_power_of_2(d // 2), BACKWARD=backward)
    return y.transpose(1, 2)


class RopeFunction(torch.autograd.Function):
    """Rotary embeddings of q and k in one kernel each way; keeps only cos and sin (the rotation's transpose is the
    gradient's)."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        ctx.save_for_backward(cos, sin)
        return rope(q, cos, sin), rope(k, cos, sin)

    @staticmethod
    def backward(ctx, g_q: torch.Tensor, g_k: torch.Tensor):
        cos, sin = ctx.saved_tensors
        return (None if g_q is None else rope(g_q, cos, sin, backward=True),
                None if g_k is None else rope(g_k, cos, sin, backward=True), None, None)
