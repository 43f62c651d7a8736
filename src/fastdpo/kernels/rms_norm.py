"""RMSNorm: weight * (x * rstd).to(x.dtype), rstd = 1 / sqrt(mean(x**2) + eps) over the last dimension, keeping only
the input and one float32 rstd per row for the backward.

transformers' RMSNorm casts its input to float32 and autograd keeps that copy, and the normalised result too: six
bytes per element beyond the input, for every norm (two per layer, plus Qwen3's per-head query and key norms). Its
eager forward upcasts, squares, averages, scales, downcasts and multiplies by the weight: about 36 bytes moved per
element, and more in the backward. The kernels read the input once and write the result once (4 bytes per bfloat16
element forward, 6 backward plus the weight's partial sums), with all arithmetic in float32. `RMSNormFunction` runs
them, or the same formulas in eager torch (bit-identical to the module's own forward)."""

from __future__ import annotations

import functools

import torch

from fastdpo.kernels.fp8 import keep_quantised
from fastdpo.kernels.launch import HAVE_TRITON, cdiv, device_programs, launch, next_power_of_2

if HAVE_TRITON:  # else no kernels: the Function's torch path
    import triton
    import triton.language as tl

    from fastdpo.kernels.fp8 import e4m3_grid, e4m3_scale

    @triton.jit(do_not_specialize=["M"])
    def _rms_fwd(X, W, Y, R, Q, S, M, N, eps, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, QUANT: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tl.arange(0, BLOCK_N)
        rmask = rows < M
        mask = rmask[:, None] & (cols < N)[None, :]
        offs = rows[:, None].to(tl.int64) * N + cols[None, :]
        x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
        # a correctly rounded mean (an H100 build rounded `/ N + eps` differently with the e4m3 copy, QUANT); the sum
        # of squares follows the layout the compiler picks, so the QUANT build's rstd may sit a float32 ulp apart
        rstd = tl.rsqrt(tl.math.div_rn(tl.sum(x * x, axis=1), tl.cast(N, tl.float32)) + eps)
        w = tl.load(W + cols, mask=cols < N, other=0.0).to(tl.float32)
        n = (x * rstd[:, None]).to(Y.dtype.element_ty).to(tl.float32)  # the module rounds before the weight
        y = (n * w[None, :]).to(Y.dtype.element_ty)
        tl.store(Y + offs, y, mask=mask)
        tl.store(R + rows, rstd, mask=rmask)
        if QUANT:  # the output in e4m3 with a scale per row, for the FP8 products that read it
            yf = y.to(tl.float32)
            scale = e4m3_scale(tl.max(tl.abs(yf), axis=1))
            tl.store(Q + offs, e4m3_grid(yf, scale[:, None]).to(Q.dtype.element_ty), mask=mask)
            tl.store(S + rows, scale, mask=rmask)

    @triton.jit(do_not_specialize=["M", "rows_per_program"])
    def _rms_bwd(G, X, W, R, DX, DW, M, N, rows_per_program, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 WEIGHT_GRAD: tl.constexpr):
        pid = tl.program_id(0)
        cols = tl.arange(0, BLOCK_N)
        cmask = cols < N
        w = tl.load(W + cols, mask=cmask, other=0.0).to(tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        start = pid * rows_per_program
        for i in range(0, rows_per_program, BLOCK_M):
            rows = start + i + tl.arange(0, BLOCK_M)
            rmask = rows < M
            mask = rmask[:, None] & cmask[None, :]
            offs = rows[:, None].to(tl.int64) * N + cols[None, :]
            x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
            g = tl.load(G + offs, mask=mask, other=0.0).to(tl.float32)
            rstd = tl.load(R + rows, mask=rmask, other=0.0)
            n = x * rstd[:, None]
            if WEIGHT_GRAD:
                acc += g * n.to(X.dtype.element_ty).to(tl.float32)
            gn = g * w[None, :]
            dot = tl.sum(gn * n, axis=1) / N
            dx = rstd[:, None] * (gn - n * dot[:, None])
            tl.store(DX + offs, dx.to(DX.dtype.element_ty), mask=mask)
        if WEIGHT_GRAD:
            tl.store(DW + pid.to(tl.int64) * N + cols, tl.sum(acc, axis=0), mask=cmask)


@functools.cache
def _row_block(n: int) -> tuple[int, int]:
    """(rows per block, columns per block) for rows of width n: a block of about 4096 elements, at least one row."""
    block_n = next_power_of_2(n)
    return max(1, min(64, 4096 // block_n)), block_n


def rms_norm_forward(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight * (x * rstd).to(x.dtype), rstd) over the last dimension; rstd is float32, one per row."""
    y, rstd, _ = _forward(x, weight, eps, False)
    return y, rstd


def rms_norm_forward_fp8(x: torch.Tensor, weight: torch.Tensor,
                         eps: float) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """`rms_norm_forward` and, from the same pass, its output as rows (M, N) in e4m3 with their float32 scales (M, 1):
    what `quantise_rowwise` gives for it, for the FP8 products that read the norm's output (--fp8)."""
    return _forward(x, weight, eps, True)


def _forward(x, weight, eps, quant: bool):
    n = x.shape[-1]
    x2 = x.reshape(-1, n).contiguous()
    m = x2.shape[0]
    y = torch.empty_like(x2)
    rstd = torch.empty(m, dtype=torch.float32, device=x.device)
    q = torch.empty(x2.shape, dtype=torch.float8_e4m3fn, device=x.device) if quant else y
    scale = torch.empty((m, 1), dtype=torch.float32, device=x.device) if quant else rstd
    block_m, block_n = _row_block(n)
    if m:
        launch(_rms_fwd, (cdiv(m, block_m),), x2, weight.contiguous(), y, rstd, q, scale, m, n, eps,
               num_warps=4 if block_n <= 4096 else 8, BLOCK_M=block_m, BLOCK_N=block_n, QUANT=quant)
    return y.view(x.shape), rstd, ((q, scale) if quant else None)


def rms_norm_backward(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor,
                      weight_grad: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(d x, d weight or None) of `rms_norm_forward`, the weight's gradient summed in float32."""
    n = x.shape[-1]
    x2, g2 = x.reshape(-1, n).contiguous(), grad.reshape(-1, n).contiguous()
    m = x2.shape[0]
    block_m, block_n = _row_block(n)
    programs = max(1, min(device_programs(x.device.index or 0) if x.is_cuda else 8, cdiv(m, block_m)))
    per = max(1, cdiv(cdiv(m, programs), block_m)) * block_m
    programs = max(1, cdiv(m, per))
    dx = torch.empty_like(x2)
    dw = torch.empty((programs, n), dtype=torch.float32, device=x.device) if weight_grad else dx
    if m:
        launch(_rms_bwd, (programs,), g2, x2, weight.contiguous(), rstd, dx, dw, m, n, per,
               num_warps=4 if block_n <= 4096 else 8, BLOCK_M=block_m, BLOCK_N=block_n, WEIGHT_GRAD=weight_grad)
    if not weight_grad:
        return dx.view(x.shape), None
    return dx.view(x.shape), (dw.sum(0) if m else torch.zeros(n, device=x.device)).to(weight.dtype)


class RMSNormFunction(torch.autograd.Function):
    """RMSNorm of x with `weight` (`fast`: on the kernels, else in eager torch, in the module's own operations and
    order); keeps x and the float32 rstd. The backward is the analytic gradient, in float32."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float, fast: bool,
                quantise: int = 0) -> torch.Tensor:
        """`quantise` (with `fast`): the number of FP8 products that read the output, for which it is also written in
        e4m3 with a scale per row, from the same kernel, and kept on it (`keep_quantised`); 0: none."""
        ctx.fast = fast
        if fast:
            if quantise:
                y, rstd, kept = rms_norm_forward_fp8(x, weight, eps)
                keep_quantised(y, "rowwise", *kept, quantise)
            else:
                y, rstd = rms_norm_forward(x, weight, eps)
            ctx.save_for_backward(x, weight, rstd)
            return y
        xf = x.to(torch.float32)
        rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        y = (xf * rstd).to(x.dtype)
        ctx.save_for_backward(x, weight, rstd)
        return weight * y

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight, rstd = ctx.saved_tensors
        if ctx.fast:
            g_x, g_weight = rms_norm_backward(grad, x, weight, rstd, ctx.needs_input_grad[1])
            return g_x, g_weight, None, None, None
        n = x.to(torch.float32) * rstd
        g_weight = None
        if ctx.needs_input_grad[1]:
            g_weight = (grad * n.to(x.dtype)).reshape(-1, weight.shape[-1]).sum(0, dtype=torch.float32).to(weight.dtype)
        g_x = None
        if ctx.needs_input_grad[0]:
            g_n = (grad * weight).to(torch.float32)
            g_x = (rstd * (g_n - n * (g_n * n).mean(-1, keepdim=True))).to(x.dtype)
        return g_x, g_weight, None, None, None
