"""SwiGLU's product silu(gate) * up: one pass forward, and one backward that gives both gradients and, for a down
projection's gradient, rebuilds the product in the same pass.

transformers' SwiGLU MLP keeps the gate, the up projection, the activated gate and their product for the backward.
`SiluMulFunction` and `SiluMulDownFunction` (the product into a plain down projection) keep gate and up only and
recompute the rest in the backward: a few elementwise passes, against 30-45 % of a layer's activation bytes on the
Qwen3 shapes. On the kernels or in eager torch; the forward rounds as eager rounds it."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fastdpo.kernels.fp8 import keep_quantised
from fastdpo.kernels.launch import HAVE_TRITON, cdiv, launch

if HAVE_TRITON:  # else no kernels: the Functions' torch path
    import triton
    import triton.language as tl

    from fastdpo.kernels.fp8 import e4m3_grid, e4m3_scale

    @triton.jit(do_not_specialize=["numel"])
    def _silu_mul_fwd(A, B, P, numel, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < numel
        a = tl.load(A + offs, mask=mask, other=0.0).to(tl.float32)
        b = tl.load(B + offs, mask=mask, other=0.0).to(tl.float32)
        act = (a * tl.sigmoid(a)).to(P.dtype.element_ty).to(tl.float32)  # silu's result in the dtype, as eager
        tl.store(P + offs, (act * b).to(P.dtype.element_ty), mask=mask)

    @triton.jit
    def _product(A, B, P, offs, mask):
        """silu(a) * b at `offs`, rounded as `_silu_mul_fwd` rounds it (in P's dtype)."""
        a = tl.load(A + offs, mask=mask, other=0.0).to(tl.float32)
        b = tl.load(B + offs, mask=mask, other=0.0).to(tl.float32)
        act = (a * tl.sigmoid(a)).to(P.dtype.element_ty).to(tl.float32)
        return (act * b).to(P.dtype.element_ty)

    @triton.jit(do_not_specialize=["M"])
    def _silu_mul_fwd_fp8(A, B, P, Q, S, M, N, BLOCK: tl.constexpr):
        """One row per program: the product written as `_silu_mul_fwd` writes it while its absolute maximum is
        taken, then read back (one tensor where computing it again would read two) and written in e4m3 with the
        row's scale (what `quantise_rowwise` gives). A barrier between the passes makes the block's writes visible
        to all of its threads, whatever layout the compiler gives the load."""
        base = tl.program_id(0).to(tl.int64) * N
        peak = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, N, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            p = _product(A, B, P, base + cols, cols < N)
            tl.store(P + base + cols, p, mask=cols < N)
            peak = tl.maximum(peak, tl.abs(p.to(tl.float32)))
        scale = e4m3_scale(tl.max(peak, axis=0))
        tl.debug_barrier()
        for start in range(0, N, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            p = tl.load(P + base + cols, mask=cols < N, other=0.0).to(tl.float32)
            tl.store(Q + base + cols, e4m3_grid(p, scale).to(Q.dtype.element_ty), mask=cols < N)
        tl.store(S + tl.program_id(0), scale)

    @triton.jit(do_not_specialize=["numel"])
    def _silu_mul_bwd(A, B, G, DA, DB, P, numel, BLOCK: tl.constexpr, PRODUCT: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < numel
        a = tl.load(A + offs, mask=mask, other=0.0).to(tl.float32)
        b = tl.load(B + offs, mask=mask, other=0.0).to(tl.float32)
        g = tl.load(G + offs, mask=mask, other=0.0).to(tl.float32)
        s = tl.sigmoid(a)
        act = a * s
        tl.store(DB + offs, (g * act).to(DB.dtype.element_ty), mask=mask)
        tl.store(DA + offs, (g * b * s * (1.0 + a * (1.0 - s))).to(DA.dtype.element_ty), mask=mask)
        if PRODUCT:
            act_r = act.to(P.dtype.element_ty).to(tl.float32)
            tl.store(P + offs, (act_r * b).to(P.dtype.element_ty), mask=mask)


ELEMENTWISE_BLOCK = 1024  # with 16 warps, two elements per thread: 2.8 TB/s forward and 3.6 backward on an H200,
ELEMENTWISE_WARPS = 16  # where 2048 over 8 warps reached 1.8 and 1.3 (numel 51M, bf16)


def silu_mul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """silu(a) * b, rounded as eager rounds it (silu's result in the dtype, then the product)."""
    a, b = a.contiguous(), b.contiguous()
    p = torch.empty_like(a)
    numel = a.numel()
    if numel:
        launch(_silu_mul_fwd, (cdiv(numel, ELEMENTWISE_BLOCK),), a, b, p, numel, num_warps=ELEMENTWISE_WARPS,
               BLOCK=ELEMENTWISE_BLOCK)
    return p


def silu_mul_fp8(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """`silu_mul` and its product as rows (M, N) in e4m3 with float32 scales (M, 1), what `quantise_rowwise` gives
    for it, from one kernel (--fp8: the down projection's input)."""
    a, b = a.contiguous(), b.contiguous()
    n = a.shape[-1]
    m = a.numel() // n if n else 0
    p = torch.empty_like(a)
    q = torch.empty((m, n), dtype=torch.float8_e4m3fn, device=a.device)
    scale = torch.empty((m, 1), dtype=torch.float32, device=a.device)
    if m and n:
        launch(_silu_mul_fwd_fp8, (m,), a, b, p, q, scale, m, n, num_warps=4, BLOCK=ELEMENTWISE_BLOCK)
    return p, (q, scale)


def silu_mul_backward(a: torch.Tensor, b: torch.Tensor, grad: torch.Tensor, product: bool = False
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(d a, d b, and with `product` silu(a) * b again) for the gradient `grad` of silu(a) * b: one pass."""
    a, b, grad = a.contiguous(), b.contiguous(), grad.contiguous()
    da, db = torch.empty_like(a), torch.empty_like(b)
    p = torch.empty_like(a) if product else da
    numel = a.numel()
    if numel:
        launch(_silu_mul_bwd, (cdiv(numel, ELEMENTWISE_BLOCK),), a, b, grad, da, db, p, numel,
               num_warps=ELEMENTWISE_WARPS, BLOCK=ELEMENTWISE_BLOCK, PRODUCT=product)
    return da, db, (p if product else None)


def silu_mul_grads_torch(gate: torch.Tensor, up: torch.Tensor, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`silu_mul_backward`'s gradients in eager torch (any device): of silu(gate) * up with respect to gate and up,
    computed in float32, returned in their dtypes."""
    gf = gate.to(torch.float32)
    s = torch.sigmoid(gf)
    g = grad.to(torch.float32)
    g_up = (g * (gf * s)).to(up.dtype)
    g_gate = (g * up.to(torch.float32) * s * (1 + gf * (1 - s))).to(gate.dtype)
    return g_gate, g_up


class SiluMulFunction(torch.autograd.Function):
    """silu(gate) * up, keeping gate and up only."""

    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor, fast: bool, quantise: int = 0) -> torch.Tensor:
        """`quantise` (with `fast`): the number of FP8 products that read the product (the down projection), for which
        it is also written in e4m3 with a scale per row, from the same kernel, and kept on it (`keep_quantised`)."""
        ctx.fast = fast
        ctx.save_for_backward(gate, up)
        if fast and quantise:
            p, (q, scale) = silu_mul_fp8(gate, up)
            keep_quantised(p, "rowwise", q, scale, quantise)
            return p
        return silu_mul(gate, up) if fast else F.silu(gate) * up

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        gate, up = ctx.saved_tensors
        if ctx.fast:
            g_gate, g_up, _ = silu_mul_backward(gate, up, grad)
        else:
            g_gate, g_up = silu_mul_grads_torch(gate, up, grad)
        return g_gate, g_up, None, None


class SiluMulDownFunction(torch.autograd.Function):
    """(silu(gate) * up) @ down.T for a plain down projection: the product is recomputed in the backward. `skip`:
    the recompute of a checkpointed region whose output nothing keeps (the caller knows: `fastdpo.model.fused`)."""

    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, fast: bool,
                skip: bool = False) -> torch.Tensor:
        ctx.fast = fast
        ctx.save_for_backward(gate, up, down)
        if skip:
            # a checkpoint's recompute of an output that only joins the residual stream, which keeps nothing of it:
            # the recompute needs only what this saves, so the product and the down projection are skipped (a
            # quarter of the layer's projection FLOPs on the Qwen3 shapes) and the output is left unwritten
            return gate.new_empty((*gate.shape[:-1], down.shape[0]))
        return F.linear(silu_mul(gate, up) if fast else F.silu(gate) * up, down)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        gate, up, down = ctx.saved_tensors
        g_p = grad @ down
        if ctx.fast:  # one pass: both gradients, and the product again for the down projection's
            g_gate, g_up, p = silu_mul_backward(gate, up, g_p, product=ctx.needs_input_grad[2])
        else:
            p = F.silu(gate) * up if ctx.needs_input_grad[2] else None
            g_gate, g_up = silu_mul_grads_torch(gate, up, g_p)
        g_down = None
        if ctx.needs_input_grad[2]:
            g_down = grad.reshape(-1, grad.shape[-1]).t() @ p.reshape(-1, p.shape[-1])
        return g_gate, g_up, g_down, None, None
