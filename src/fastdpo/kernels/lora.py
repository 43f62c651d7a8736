"""The LoRA linear, base(x) + s * dropout(x) @ A^T @ B^T, in three GEMMs and no extra pass over the output; with
dropout on the kernels, the mask applied in registers and never stored.

PEFT's forward casts x to the adapter's dtype (float32 for a bfloat16 model: a copy of x, saved for the backward,
once per projection, so q, k and v keep three), multiplies B's output by the scaling and adds it to the base's:
passes over the layer's output as wide as the projection (12,288 columns for an 8B model's MLP). Here the adapter's
product is computed in the input's dtype with float32 accumulation, and the base output is added in the second
GEMM's epilogue (`addmm`); only x (shared by q, k and v) and x @ A^T (rank columns) are kept for the backward, and
the adapters' gradients come out in their own dtype. Numerically: the same sum, rounded once to the output dtype,
with A and B read in the input's dtype.

With dropout, where the kernels serve (CUDA), dropout(x) is never written: one kernel applies the mask in registers
on the way into x @ A^T, and the backward's two kernels draw the same mask again (Philox keyed by a seed from
torch's generator and each element's index) for x's and A's gradients. Elsewhere the mask is drawn by
`bernoulli_`, kept for the backward, and applied by torch.

`SiluMulLoraDownFunction` is a SwiGLU MLP's product silu(gate) * up into a LoRA down projection as one autograd
function: gate and up are kept, as the MLP keeps them anyway, and the product is rebuilt in the backward instead of
being kept for A's gradient (a sixth of a layer's bytes on an 8B model). Which layers and calls these Functions
serve is decided in `fastdpo.model.lora`."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from fastdpo.kernels.launch import (
    HAVE_TRITON,
    INTERPRET,
    available,
    cdiv,
    device_programs,
    has_out_dtype,
    launch,
    next_power_of_2,
)
from fastdpo.kernels.swiglu import silu_mul, silu_mul_backward, silu_mul_grads_torch

if HAVE_TRITON:  # else no kernels: the mask is drawn by torch
    import triton
    import triton.language as tl

    @triton.jit
    def _dot(a, b, acc, UPCAST: tl.constexpr):
        """a @ b + acc, float32 operands in full precision (not TF32, as torch's matmul by default); with UPCAST
        (Triton's interpreter, whose dot mishandles bfloat16) on the operands' float32 values, the same sum as the
        tensor cores' float32 accumulation of them."""
        if UPCAST:
            return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
        if a.dtype == tl.float32:
            return tl.dot(a, b, acc, input_precision="ieee")
        return tl.dot(a, b, acc)

    DROPOUT_ROUNDS = tl.constexpr(7)

    @triton.jit
    def _kept(seed, rows, k0, K, threshold, BLOCK_K: tl.constexpr):
        """Which elements of rows `rows`, columns k0 .. k0 + BLOCK_K of a (M, K) input dropout keeps (k0 a multiple of 8):
        one Philox call per eight columns (keyed by the call's seed and the group's index) gives four 32-bit words, and
        each column takes one 16-bit half of one of them; an element is kept when its half reaches `threshold` (p * 2**16,
        rounded). Every kernel of one call thus draws the same mask without storing it. Philox runs `DROPOUT_ROUNDS`
        rounds, not Triton's default 10, and each word serves two elements: the kernels' integer work is most of their
        time, and a dropout mask needs no cryptographic margin."""
        groups = rows[:, None] * tl.cdiv(K, 8) + (k0 // 8 + tl.arange(0, BLOCK_K // 8))[None, :]
        r0, r1, r2, r3 = tl.randint4x(seed, groups, DROPOUT_ROUNDS)
        r = tl.interleave(tl.interleave(r0, r2), tl.interleave(r1, r3)).to(tl.uint32, bitcast=True)  # word of 2 columns
        halves = tl.interleave(r & 0xFFFF, r >> 16)  # column j: half j % 2 of word j // 2
        return halves.to(tl.int32) >= threshold

    # neither the seed, the row count nor the drop threshold is specialised on: the kernels built ahead (at p = 0.5)
    # serve every run's p (0.05's threshold, 3277, is not a multiple of 16 as 0.5's is)
    @triton.jit(do_not_specialize=["seed", "M", "threshold"])
    def _lora_keep(seed, OUT, M, K, threshold, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
        """The mask the kernels below apply, as int8 (M, K): what the tests compare them with."""
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        k0 = tl.program_id(1) * BLOCK_K
        cols = k0 + tl.arange(0, BLOCK_K)
        keep = _kept(seed, rows, k0, K, threshold, BLOCK_K)
        tl.store(OUT + rows[:, None] * K + cols[None, :], keep.to(tl.int8), mask=(rows < M)[:, None] & (cols < K)[None, :])

    @triton.jit(do_not_specialize=["seed", "M", "threshold"])
    def _lora_drop_down(X, A, seed, T, M, K, R, threshold, inv_keep, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
                        BLOCK_R: tl.constexpr, UPCAST: tl.constexpr):
        """T (M, R) = dropout(X) @ A^T for X (M, K) and A (R, K) of X's dtype: the dropped input, each element rounded
        to the dtype as x * mask / (1 - p) is, lives in registers only; float32 accumulation."""
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        ranks = tl.arange(0, BLOCK_R)
        rmask = rows < M
        acc = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            cmask = cols < K
            x = tl.load(X + rows[:, None] * K + cols[None, :], mask=rmask[:, None] & cmask[None, :], other=0.0)
            keep = _kept(seed, rows, k0, K, threshold, BLOCK_K)
            xd = tl.where(keep, x.to(tl.float32) * inv_keep, 0.0).to(x.dtype)
            a = tl.load(A + ranks[None, :] * K + cols[:, None], mask=cmask[:, None] & (ranks < R)[None, :], other=0.0)
            acc = _dot(xd, a, acc, UPCAST)
        tl.store(T + rows[:, None] * R + ranks[None, :], acc.to(T.dtype.element_ty),
                 mask=rmask[:, None] & (ranks < R)[None, :])

    @triton.jit(do_not_specialize=["seed", "M", "threshold"])
    def _lora_drop_dx(GT, A, seed, DX, M, K, R, threshold, coef, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
                      BLOCK_R: tl.constexpr, UPCAST: tl.constexpr):
        """DX (M, K) = ((GT @ A) * mask) * coef for GT (M, R) and A (R, K): the input's gradient through the adapter
        (coef: the adapter's scale over 1 - p), in float32 and rounded once."""
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        k0 = tl.program_id(1) * BLOCK_K
        cols = k0 + tl.arange(0, BLOCK_K)
        ranks = tl.arange(0, BLOCK_R)
        rmask, cmask, kmask = rows < M, cols < K, ranks < R
        gt = tl.load(GT + rows[:, None] * R + ranks[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0)
        a = tl.load(A + ranks[:, None] * K + cols[None, :], mask=kmask[:, None] & cmask[None, :], other=0.0)
        v = _dot(gt, a, tl.zeros([BLOCK_M, BLOCK_K], dtype=tl.float32), UPCAST)
        d = tl.where(_kept(seed, rows, k0, K, threshold, BLOCK_K), v * coef, 0.0)
        tl.store(DX + rows[:, None] * K + cols[None, :], d.to(DX.dtype.element_ty), mask=rmask[:, None] & cmask[None, :])

    @triton.jit(do_not_specialize=["seed", "M", "threshold", "rows_per_program"])
    def _lora_drop_da(GT, X, seed, P, M, K, R, threshold, inv_keep, rows_per_program, BLOCK_M: tl.constexpr,
                      BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr, UPCAST: tl.constexpr):
        """P[s] (R, K) = GT[rows of s]^T @ dropout(X)[rows of s], float32: program (k, s) sums its span of rows for
        one block of columns; the caller sums the spans (no atomics: the same sum every run)."""
        k0 = tl.program_id(0) * BLOCK_K
        cols = k0 + tl.arange(0, BLOCK_K)
        span = tl.program_id(1)
        ranks = tl.arange(0, BLOCK_R)
        cmask, kmask = cols < K, ranks < R
        acc = tl.zeros([BLOCK_R, BLOCK_K], dtype=tl.float32)
        start = span * rows_per_program
        for i in range(0, rows_per_program, BLOCK_M):
            rows = start + i + tl.arange(0, BLOCK_M)
            rmask = (rows < M) & (rows < start + rows_per_program)
            x = tl.load(X + rows[:, None] * K + cols[None, :], mask=rmask[:, None] & cmask[None, :], other=0.0)
            keep = _kept(seed, rows, k0, K, threshold, BLOCK_K)
            xd = tl.where(keep, x.to(tl.float32) * inv_keep, 0.0).to(x.dtype)
            gt = tl.load(GT + rows[None, :] * R + ranks[:, None], mask=kmask[:, None] & rmask[None, :], other=0.0)
            acc = _dot(gt, xd, acc, UPCAST)
        tl.store(P + span * R * K + ranks[:, None] * K + cols[None, :], acc, mask=kmask[:, None] & cmask[None, :])


LORA_MAX_RANK = 128  # above it the LoRA dropout kernels' register tiles grow too large: the torch path serves
LORA_BLOCK_M, LORA_BLOCK_K = 32, 128
LORA_DOWN_BLOCK_M = 16  # x @ A^T: one program per 16 rows, so that a few thousand rows keep every SM busy


def lora_dropout_threshold(p: float) -> int:
    """The kernels keep an element when its 16 random bits reach this: a drop probability of p to the nearest
    multiple of 2**-16 (within 7.7e-6 of p; 0.05 draws 0.0500031), and never 0 for a p above 0. The kept elements are
    scaled by 1 / (1 - p), as torch's dropout scales them."""
    return max(round(p * 2**16), 1) if p > 0 else 0


def _upcast(t: torch.Tensor) -> bool:
    return INTERPRET and t.dtype != torch.float32


def lora_rank_block(rank: int) -> int:
    return max(16, next_power_of_2(rank))  # tl.dot's smallest side


def lora_dropout_serves(x: torch.Tensor, rank: int) -> bool:
    """The LoRA dropout kernels serve a (M, K) input `x` for an adapter of `rank`: `available(x)`, a rank they
    hold in registers, and fewer than 2**31 elements (the masks are keyed by an element's int32 index)."""
    return available(x) and x.dim() == 2 and rank <= LORA_MAX_RANK and x.numel() < 2**31


def lora_dropout_seed() -> int:
    """A 31-bit seed from torch's CPU generator (no device work, no sync): what keys one call's masks. A recompute
    that restores the generator's state draws the same seed, hence the same masks."""
    return int(torch.randint(2**31 - 1, (1,)).item())


def lora_dropout_keep(seed: int, shape: tuple[int, int], p: float, device: torch.device) -> torch.Tensor:
    """The bool mask (M, K) that the LoRA dropout kernels apply for `seed` and drop probability `p`."""
    m, k = shape
    out = torch.empty((m, k), dtype=torch.int8, device=device)
    if out.numel():
        launch(_lora_keep, (cdiv(m, LORA_BLOCK_M), cdiv(k, LORA_BLOCK_K)), seed, out, m, k,
               lora_dropout_threshold(p), num_warps=4, BLOCK_M=LORA_BLOCK_M, BLOCK_K=LORA_BLOCK_K)
    return out.bool()


def lora_dropout_down(x: torch.Tensor, a: torch.Tensor, seed: int, p: float) -> torch.Tensor:
    """(x * mask / (1 - p)) @ a^T for x (M, K) and a (R, K) of x's dtype, the mask drawn from `seed` and never
    stored: (M, R) in x's dtype, float32 accumulation."""
    m, k = x.shape
    r = a.shape[0]
    x, a = x.contiguous(), a.contiguous()
    t = torch.empty((m, r), dtype=x.dtype, device=x.device)
    if m:
        launch(_lora_drop_down, (cdiv(m, LORA_DOWN_BLOCK_M),), x, a, seed, t, m, k, r,
               lora_dropout_threshold(p), 1.0 / (1.0 - p), num_warps=4, BLOCK_M=LORA_DOWN_BLOCK_M, BLOCK_K=LORA_BLOCK_K,
               BLOCK_R=lora_rank_block(r), UPCAST=_upcast(x))
    return t


def lora_dropout_input_grad(gt: torch.Tensor, a: torch.Tensor, seed: int, p: float,
                            scale: float) -> torch.Tensor:
    """The gradient of `lora_dropout_down`'s x for the gradient `gt` (M, R) of its output, times `scale`:
    ((gt @ a) * mask) * scale / (1 - p), (M, K) in gt's dtype, rounded once."""
    m, r = gt.shape
    k = a.shape[1]
    gt, a = gt.contiguous(), a.contiguous()
    dx = torch.empty((m, k), dtype=gt.dtype, device=gt.device)
    if m and k:
        grid = (cdiv(m, LORA_BLOCK_M), cdiv(k, LORA_BLOCK_K))
        launch(_lora_drop_dx, grid, gt, a, seed, dx, m, k, r, lora_dropout_threshold(p), scale / (1.0 - p),
               num_warps=4, BLOCK_M=LORA_BLOCK_M, BLOCK_K=LORA_BLOCK_K, BLOCK_R=lora_rank_block(r), UPCAST=_upcast(gt))
    return dx


def lora_dropout_weight_grad(gt: torch.Tensor, x: torch.Tensor, seed: int, p: float) -> torch.Tensor:
    """gt^T @ (x * mask / (1 - p)): the gradient of `lora_dropout_down`'s a for the gradient `gt` (M, R) of its
    output, (R, K) in float32. Spans of rows are summed by programs of their own, then added (no atomics)."""
    m, r = gt.shape
    k = x.shape[1]
    gt, x = gt.contiguous(), x.contiguous()
    col_blocks = cdiv(k, LORA_BLOCK_K)
    spans = max(1, min(cdiv(m, LORA_BLOCK_M), cdiv(device_programs(x.device.index or 0) if x.is_cuda else 8, col_blocks)))
    per = cdiv(cdiv(m, spans), LORA_BLOCK_M) * LORA_BLOCK_M if m else LORA_BLOCK_M
    spans = max(1, cdiv(m, per))
    parts = torch.empty((spans, r, k), dtype=torch.float32, device=x.device)
    if not m:
        return parts.zero_().sum(0)
    launch(_lora_drop_da, (col_blocks, spans), gt, x, seed, parts, m, k, r, lora_dropout_threshold(p),
           1.0 / (1.0 - p), per, num_warps=4, BLOCK_M=LORA_BLOCK_M, BLOCK_K=LORA_BLOCK_K, BLOCK_R=lora_rank_block(r),
           UPCAST=_upcast(x))
    return parts.sum(0) if spans > 1 else parts[0]


def _weight_grad(a: torch.Tensor, b: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """scale * a @ b in `dtype` (an adapter's float32 gradient from bfloat16 factors: written by the GEMM in float32
    on CUDA, where torch offers that)."""
    if a.is_cuda and a.dtype != dtype and dtype == torch.float32 and has_out_dtype():
        out = torch.mm(a, b, out_dtype=torch.float32)
    else:
        out = (a @ b).to(dtype)
    return out.mul_(scale) if scale != 1.0 else out


def _adapter_down(x: torch.Tensor, a_w: torch.Tensor, p: float):
    """dropout(x) @ A^T, (N, r), with what the backward needs to apply the same dropout: (t, mask, seed). Where the
    Triton kernels serve, the mask is drawn from a seed inside the kernels and never stored; else by `bernoulli_`."""
    mask = seed = None
    if p > 0 and lora_dropout_serves(x, a_w.shape[0]):
        seed = lora_dropout_seed()  # the masks: drawn in each kernel from it, never stored
        return lora_dropout_down(x, a_w, seed, p), None, seed
    xd = x
    if p > 0:
        mask = torch.empty_like(x, dtype=torch.bool).bernoulli_(1.0 - p)
        xd = x * mask * (1.0 / (1.0 - p))
    return xd @ a_w.t(), mask, seed


def _adapter_input_grad(gt: torch.Tensor, a_w: torch.Tensor, scale: float, p: float, seed, mask,
                        base: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """The adapter's share of x's gradient, scale * dropout'(gt @ A), for `gt` the gradient of x @ A^T; with `base`
    (g, W), plus the base's share g @ W, added by its GEMM into the adapter's (in place: no copy, no add kernel)."""
    if seed is not None:
        g_x = lora_dropout_input_grad(gt, a_w, seed, p, scale)
    elif mask is not None:
        g_x = torch.mm(gt, a_w).mul_(mask).mul_(scale / (1.0 - p))
    elif base is not None and math.frexp(scale)[0] != 0.5:  # a scale that is not a power of two: in the GEMM
        return torch.mm(*base).addmm_(gt, a_w, alpha=scale)
    else:  # a power of two scales gt exactly, and the product needs no pass of its own
        g_x = torch.mm(gt * scale if scale != 1.0 else gt, a_w)
    return g_x.addmm_(*base) if base is not None else g_x


def _adapter_a_grad(gt: torch.Tensor, x: torch.Tensor, scale: float, p: float, seed, mask,
                    dtype: torch.dtype) -> torch.Tensor:
    """A's gradient, scale * gt^T @ dropout(x), in A's `dtype`."""
    if seed is not None:
        g_a = lora_dropout_weight_grad(gt, x, seed, p)
        return (g_a.mul_(scale) if scale != 1.0 else g_a).to(dtype)
    xd = x if mask is None else x * mask * (1.0 / (1.0 - p))
    return _weight_grad(gt.t(), xd, scale, dtype)


class LoraLinearFunction(torch.autograd.Function):
    """x @ W^T (+ bias) + scale * (dropout(x) @ A^T) @ B^T for 2-D x (N, in) over a frozen base weight W: the base
    GEMM writes the output and the adapter's GEMM adds into it in place; in the backward the adapter's share of x's
    gradient is written first and the base's GEMM adds into it. x's gradient thus leaves as one tensor, not two that
    autograd would add (a pass over x's width per projection), and no output is copied before a GEMM adds into it
    (what an out-of-place `addmm` does)."""

    @staticmethod
    def forward(ctx, x, W, bias, A, B, scale: float, p: float):
        a_w, b_w = A.to(x.dtype), B.to(x.dtype)
        t, mask, seed = _adapter_down(x, a_w, p)
        out = F.linear(x, W, bias).addmm_(t, b_w.t(), alpha=scale)
        ctx.save_for_backward(x, W, t, a_w, b_w, mask)
        ctx.scale, ctx.p, ctx.seed, ctx.dtypes = scale, p, seed, (A.dtype, B.dtype)
        return out

    @staticmethod
    def backward(ctx, g):
        x, W, t, a_w, b_w, mask = ctx.saved_tensors
        scale, p, seed = ctx.scale, ctx.p, ctx.seed
        g = g.contiguous()
        gt = g @ b_w  # (N, r): the gradient of t, before the scale
        g_x = g_a = g_b = None
        if ctx.needs_input_grad[0]:
            g_x = _adapter_input_grad(gt, a_w, scale, p, seed, mask, (g, W))
        if ctx.needs_input_grad[3]:
            g_a = _adapter_a_grad(gt, x, scale, p, seed, mask, ctx.dtypes[0])
        if ctx.needs_input_grad[4]:
            g_b = _weight_grad(g.t(), t, scale, ctx.dtypes[1])
        return g_x, None, None, g_a, g_b, None, None


class LoraAddFunction(torch.autograd.Function):
    """y + scale * (dropout(x) @ A^T) @ B^T for 2-D x (N, in) and the output y (N, out) of a base that is not a plain
    frozen linear (a quantized one): the base's own backward gives its share of x's gradient."""

    @staticmethod
    def forward(ctx, x, y, A, B, scale: float, p: float):
        a_w, b_w = A.to(x.dtype), B.to(x.dtype)
        t, mask, seed = _adapter_down(x, a_w, p)
        out = torch.addmm(y, t, b_w.t(), alpha=scale)
        ctx.save_for_backward(x, t, a_w, b_w, mask)
        ctx.scale, ctx.p, ctx.seed, ctx.dtypes = scale, p, seed, (A.dtype, B.dtype)
        return out

    @staticmethod
    def backward(ctx, g):
        x, t, a_w, b_w, mask = ctx.saved_tensors
        scale, p, seed = ctx.scale, ctx.p, ctx.seed
        g = g.contiguous()
        gt = g @ b_w  # (N, r): the gradient of t, before the scale
        g_x = g_a = g_b = None
        if ctx.needs_input_grad[0]:
            g_x = _adapter_input_grad(gt, a_w, scale, p, seed, mask)
        if ctx.needs_input_grad[2]:
            g_a = _adapter_a_grad(gt, x, scale, p, seed, mask, ctx.dtypes[0])
        if ctx.needs_input_grad[3]:
            g_b = _weight_grad(g.t(), t, scale, ctx.dtypes[1])
        return g_x, g, g_a, g_b, None, None


class SiluMulLoraDownFunction(torch.autograd.Function):
    """A SwiGLU MLP's end through a LoRA down projection over a frozen base weight W (no bias), for 2-D gate and up
    (N, inter): h = silu(gate) * up, then h @ W^T + scale * (dropout(h) @ A^T) @ B^T.

    Keeps gate, up and h @ A^T (rank columns), not h (off the kernels, dropout's mask too, a byte per element): the
    backward rebuilds h in the same pass that takes the product's gradients (as the plain down projection's does),
    which saves a third of what a layer's MLP keeps. In a checkpointed region's recompute whose output only joins the
    residual stream (`skip`), the base GEMM, whose output nothing keeps, is not run: the output is left unwritten."""

    @staticmethod
    def forward(ctx, gate, up, W, A, B, scale: float, p: float, fast: bool, skip: bool):
        a_w, b_w = A.to(gate.dtype), B.to(gate.dtype)
        h = silu_mul(gate, up) if fast else F.silu(gate) * up
        t, mask, seed = _adapter_down(h, a_w, p)
        if skip:
            out = gate.new_empty((gate.shape[0], W.shape[0]))
        else:
            out = F.linear(h, W).addmm_(t, b_w.t(), alpha=scale)
        ctx.save_for_backward(gate, up, W, t, a_w, b_w, mask)
        ctx.scale, ctx.p, ctx.seed, ctx.fast, ctx.dtypes = scale, p, seed, fast, (A.dtype, B.dtype)
        return out

    @staticmethod
    def backward(ctx, g):
        gate, up, W, t, a_w, b_w, mask = ctx.saved_tensors
        scale, p, seed = ctx.scale, ctx.p, ctx.seed
        g = g.contiguous()
        gt = g @ b_w
        # h's gradient: the adapter's share, with the base's GEMM adding into it
        g_h = _adapter_input_grad(gt, a_w, scale, p, seed, mask, (g, W))
        want_a = ctx.needs_input_grad[3]
        if ctx.fast:
            g_gate, g_up, h = silu_mul_backward(gate, up, g_h, product=want_a)
        else:
            h = F.silu(gate) * up if want_a else None
            g_gate, g_up = silu_mul_grads_torch(gate, up, g_h)
        g_a = _adapter_a_grad(gt, h, scale, p, seed, mask, ctx.dtypes[0]) if want_a else None
        g_b = _weight_grad(g.t(), t, scale, ctx.dtypes[1]) if ctx.needs_input_grad[4] else None
        return g_gate, g_up, None, g_a, g_b, None, None, None, None
