"""A frozen linear whose weight is held in FP8 (e4m3, one float32 scale per output row): y = x @ W^T, and x's
gradient dY @ W, both as FP8 matrix products. No weight gradient: the weight is frozen (a LoRA base).

The weight is quantised once (`quantise_rowwise`: each row's absolute maximum maps to e4m3's largest value, 448),
x per token at each call. On CUDA GPUs that have FP8 tensor cores (compute capability 8.9: Ada, Hopper) the products
run as `torch._scaled_mm` with the row-wise scales applied in its epilogue; elsewhere (the CPU, tests, and shapes
`_scaled_mm` refuses) they are emulated: the same e4m3 values and scales, dequantised to float32 and multiplied in
float32, so the emulation computes what the GPU computes up to the order of the float32 sums.

The input gradient dX = dY @ W needs W's scales along the product's inner dimension (W's rows), where `_scaled_mm`
takes only outer (row / column) scales. The algebra W = diag(s_w) Wq gives dX = (dY diag(s_w)) @ Wq exactly: dY's
columns are multiplied by the weight's row scales, the product quantised per row to e4m3, and multiplied by the
same Wq the forward uses, with no scale on its side. No second FP8 copy of the weight is kept (that would cost what a
bfloat16 weight costs); `_scaled_mm`'s second operand must be column-major, so the backward takes a transposed copy
of Wq for the call (one layer's FP8 weight at a time, freed after). The gradient is quantised to e4m3, not e5m2: the
per-row scale already covers the range between tokens, and e4m3's extra mantissa bit halves the rounding error
within a row (torchao's row-wise recipe chooses the same). On CUDA the quantisation of an activation or a gradient
is one Triton kernel (multiplying by the column scales, the row maximum, the scale and the cast, one row per
program), launched without Triton's dispatch.

`_scaled_mm` needs the inner and outer widths (in and out features) to be multiples of 16 and a bfloat16 output
with row-wise scales; a layer that misses these (tiny test models, float16 or float32 activations) runs the
emulation on the GPU too: correct, slow, and never met by the shapes of real models."""

from __future__ import annotations

import functools

import torch

from fastdpo.kernels.launch import HAVE_TRITON, available, launch

if HAVE_TRITON:  # the rounding the fused quantising kernels (norm, SwiGLU) share
    import triton
    import triton.language as tl

    @triton.jit
    def e4m3_scale(amax):
        """The float32 scale of values whose absolute maximum is `amax`, as `quantise_rowwise` computes it: amax
        (at least 1e-12) over 448, e4m3's largest value, correctly rounded. The quotient is taken in float64 and
        rounded once to float32: on the GPU a float32 division by the constant 448 compiled to a result one ulp
        off for half the rows (an H100), while a float64 quotient of a float32 by 448 = 7 * 2**6 is never near
        enough a float32 rounding midpoint for its own rounding (or a compiler's reciprocal) to change the result."""
        return (tl.maximum(amax, 1e-12).to(tl.float64) / 448.0).to(tl.float32)

    @triton.jit
    def e4m3_grid(v, scale):
        """float32 `v` over `scale` (broadcast to v's shape), correctly rounded, clamped to +-448 and rounded to nearest
        even on e4m3's grid (three mantissa bits; subnormals below 2**-6) in float32 arithmetic: the cast to e4m3 that
        follows is exact whatever rounding it applies (Triton's interpreter truncates), and equals torch's cast of
        the same quotient."""
        x = tl.clamp(tl.math.div_rn(v, scale), -448.0, 448.0)
        e = tl.maximum(((x.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, -6)
        quantum = ((e - 3 + 127) << 23).to(tl.float32, bitcast=True)
        magic = quantum * 12582912.0  # 1.5 * 2**23 quanta: adding it rounds to a multiple of the quantum
        return (x + magic) - magic

    @triton.jit
    def _row_values(X, C, base, cols, mask, HAS_COL: tl.constexpr):
        """float32 values of a row at `cols` (0 where masked), times the column scales `C` when `HAS_COL`."""
        v = tl.load(X + base + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_COL:
            v = v * tl.load(C + cols, mask=mask, other=0.0)
        return v

    @triton.jit(do_not_specialize=["M"])
    def _quantise_rows(X, C, Q, S, M, N, HAS_COL: tl.constexpr, BLOCK: tl.constexpr):
        """One row per program: the row's absolute maximum, its scale, then the row on e4m3's grid: what
        `_quantise` gives, bit for bit (the same float32 products with the column scales, the correctly rounded
        scale and quotient)."""
        row = tl.program_id(0).to(tl.int64)
        base = row * N
        peak = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, N, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            peak = tl.maximum(peak, tl.abs(_row_values(X, C, base, cols, cols < N, HAS_COL)))
        scale = e4m3_scale(tl.max(peak, axis=0))
        for start in range(0, N, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            v = _row_values(X, C, base, cols, cols < N, HAS_COL)
            tl.store(Q + base + cols, e4m3_grid(v, scale).to(Q.dtype.element_ty), mask=cols < N)
        tl.store(S + row, scale)

E4M3 = torch.float8_e4m3fn
E4M3_MAX = torch.finfo(E4M3).max  # 448
_TINY = 1e-12  # a row of zeros gets this amax: its values quantise to 0 whatever the scale


def _scale(amax: torch.Tensor, fmax: float) -> torch.Tensor:
    """float32 `amax` (at least 1e-12) over the format's largest value, correctly rounded, on every device and
    compiled or not (as `e4m3_scale` computes it in the fused kernels): the quotient in float64, rounded once to
    float32. A float32 quotient would not be: CUDA's eager torch divides by a scalar as a multiplication by its
    reciprocal, one ulp off for about half the rows (an H100), and a compiler may divide approximately."""
    return (amax.clamp(min=_TINY).double() / fmax).float()


def _quantise(x: torch.Tensor, col_scale: torch.Tensor | None, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    fmax = torch.finfo(dtype).max
    xf = x.detach().float() if col_scale is None else x.detach().float() * col_scale
    scale = _scale(xf.abs().amax(dim=-1, keepdim=True), fmax)
    return (xf / scale).clamp(-fmax, fmax).to(dtype), scale


def quantise_rowwise(x: torch.Tensor, dtype: torch.dtype = E4M3,
                     col_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, scale) for a 2-D `x` (M, K): q (M, K) in the FP8 `dtype`, scale (M, 1) float32, with x ~ q * scale; each
    row's scale is its absolute maximum over the format's largest value, so that the row's largest element maps
    to it (computed in float32, clamped, then cast: round to nearest even). `col_scale` (1, K), float32: quantise
    x * col_scale instead (each column multiplied first, in the same pass).

    In e4m3 where the kernels serve (`available`: CUDA, or the CPU under Triton's interpreter), one Triton kernel
    (one row per program: the maximum, then the values), launched directly (`launch`): eager torch's five passes
    over the activation cost more than the FP8 product saves (measured on an H100, see the training guide), and a
    torch.compile'd function's guards and wrapper cost the host more per call than the device's work on the
    small tensors of a layer (entry 71 of the performance log). Elsewhere (other FP8 formats, kernels turned off),
    and inside a compiled region (which fuses them itself), eager torch, which gives the same bits."""
    if dtype == E4M3 and x.dim() == 2 and available(x) and not torch.compiler.is_compiling():
        return _quantise_kernel(x, col_scale)
    return _quantise(x, col_scale, dtype)


QUANTISE_BLOCK = 1024  # elements of a row per loop step: a 4,096-wide row in four


def _quantise_kernel(x: torch.Tensor, col_scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    x = x.detach().contiguous()
    m, n = x.shape
    q = torch.empty((m, n), dtype=E4M3, device=x.device)
    scale = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    if m and n:
        c = scale if col_scale is None else col_scale.detach().float().contiguous()
        launch(_quantise_rows, (m,), x, c, q, scale, m, n, num_warps=4, HAS_COL=col_scale is not None,
               BLOCK=QUANTISE_BLOCK)
    return q, scale


def _quantise_tensor(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    fmax = torch.finfo(dtype).max
    xf = x.detach().float()
    scale = _scale(xf.abs().amax().reshape(1, 1), fmax)
    return (xf / scale).clamp(-fmax, fmax).to(dtype), scale


@functools.cache
def _compiled_quantise_tensor():
    return torch.compile(_quantise_tensor, dynamic=True)


def quantise_tensorwise(x: torch.Tensor, dtype: torch.dtype = E4M3) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, scale) for a 2-D `x`: one float32 scale (1, 1) for the whole tensor, its absolute maximum over the format's
    largest value (one compiled kernel on CUDA, as `quantise_rowwise`)."""
    if x.is_cuda and HAVE_TRITON and not torch.compiler.is_compiling():
        return _compiled_quantise_tensor()(x, dtype)
    return _quantise_tensor(x, dtype)


RECIPES = ("rowwise", "tensorwise")


def keep_quantised(t: torch.Tensor, recipe: str, q: torch.Tensor, scale: torch.Tensor, uses: int) -> None:
    """Keep on the activation `t` its rows quantised by `recipe` (q (M, K), scale) for the `uses` FP8 products that
    read `t` next, so that none quantises it again (q, k and v read one normed input; gate and up another; a norm or
    SwiGLU kernel quantises its output in the pass that writes it). Valid while `t` is unchanged; dropped once the
    `uses` have read it, so that the copy does not live as long as `t` (which autograd may keep for the backward)."""
    if uses > 0:
        t._fastdpo_fp8_input = [recipe, t._version, q, scale, uses]


def kept_quantised(t: torch.Tensor, recipe: str) -> tuple[torch.Tensor, torch.Tensor] | None:
    """What `keep_quantised` kept on `t` for `recipe`, if `t` has not changed since; counts one use."""
    memo = t.__dict__.get("_fastdpo_fp8_input")
    if memo is None or memo[0] != recipe or memo[1] != t._version:
        return None
    memo[4] -= 1
    if memo[4] <= 0:
        del t._fastdpo_fp8_input
    return memo[2], memo[3]


def quantise(x: torch.Tensor, recipe: str) -> tuple[torch.Tensor, torch.Tensor]:
    """`x` in e4m3 with the recipe's scales: one per row (`rowwise`: per token for an activation, per output feature
    for a weight) or one for the tensor (`tensorwise`)."""
    return quantise_rowwise(x) if recipe == "rowwise" else quantise_tensorwise(x)


def dequantise(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """q * scale in float32: the values an FP8 tensor and its row scales stand for."""
    return q.float() * scale


def scaled_mm_serves(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype) -> bool:
    """`torch._scaled_mm` computes a @ b^T for FP8 a (M, K) and b (N, K) with row-wise scales here: on a CUDA GPU
    of compute capability 8.9 or newer, K and N multiples of 16, a bfloat16 output."""
    if not (a.is_cuda and b.is_cuda and out_dtype == torch.bfloat16):
        return False
    if a.shape[1] % 16 or b.shape[0] % 16 or b.shape[1] % 16:
        return False
    return torch.cuda.get_device_capability(a.device) >= (8, 9)


def fp8_matmul(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor | None,
               out_dtype: torch.dtype, emulate: bool = False) -> torch.Tensor:
    """(a * a_scale) @ (b * b_scale)^T in `out_dtype` for FP8 a (M, K), b (N, K) and float32 row scales a_scale
    (M, 1), b_scale (N, 1) (None: 1). `_scaled_mm` where it serves (b read column-major: b must be row-major (N, K),
    as a weight is stored), else (or with `emulate`) float32 math on the dequantised values."""
    if not emulate and scaled_mm_serves(a, b, out_dtype):
        if b_scale is None:
            b_scale = torch.ones((b.shape[0], 1), dtype=torch.float32, device=b.device)
        return torch._scaled_mm(a.contiguous(), b.t(), scale_a=a_scale.contiguous(), scale_b=b_scale.t().contiguous(),
                                out_dtype=out_dtype)
    bf = b.float() if b_scale is None else dequantise(b, b_scale)
    return (dequantise(a, a_scale) @ bf.t()).to(out_dtype)


def fp8_linear_forward(x: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor, emulate: bool = False) -> torch.Tensor:
    """x @ W^T in x's dtype for a 2-D x (M, K) and the FP8 weight wq (N, K) with its row scales (N, 1): x quantised
    per row to e4m3."""
    xq, x_scale = quantise_rowwise(x)
    return fp8_matmul(xq, x_scale, wq, w_scale, x.dtype, emulate)


def fp8_linear_input_grad(g: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor,
                          emulate: bool = False) -> torch.Tensor:
    """dY @ W in g's dtype for the output's gradient g (M, N): (g * w_scale^T) quantised per row to e4m3, times wq
    (N, K) (taken transposed, so that `_scaled_mm` reads it column-major)."""
    gq, g_scale = quantise_rowwise(g, col_scale=w_scale.t())
    return fp8_matmul(gq, g_scale, wq.t().contiguous(), None, g.dtype, emulate)


class Fp8LinearFunction(torch.autograd.Function):
    """x @ W^T (+ bias) for 2-D x (M, in) over a frozen FP8 weight `wq` (out, in) with float32 row scales `w_scale`
    (out, 1): both products (the output and x's gradient) in FP8. Nothing of x is kept for the backward: the weight
    has no gradient, and x's gradient needs only the weight. `emulate`: the float32 emulation even where
    `_scaled_mm` serves (what the GPU tests compare against)."""

    @staticmethod
    def forward(ctx, x, wq, w_scale, bias, emulate: bool = False):
        out = fp8_linear_forward(x, wq, w_scale, emulate)
        if bias is not None:
            out = out.add_(bias.to(out.dtype))
        ctx.save_for_backward(wq, w_scale)
        ctx.emulate = emulate
        return out

    @staticmethod
    def backward(ctx, g):
        wq, w_scale = ctx.saved_tensors
        g = g.contiguous()
        g_x = fp8_linear_input_grad(g, wq, w_scale, ctx.emulate) if ctx.needs_input_grad[0] else None
        g_bias = g.sum(0) if ctx.needs_input_grad[3] else None
        return g_x, None, None, g_bias, None


class Fp8TrainLinearFunction(torch.autograd.Function):
    """x @ W^T (+ bias) for 2-D x (M, in) over a trained weight W (out, in) kept in x's dtype (`--fp8`): the output
    and x's gradient as FP8 products, W's gradient dY^T @ x in x's dtype.

    `wq`, `w_scale`: W quantised by the recipe (the caller quantises it, once per forward, or once for a frozen
    weight); `xq`, `x_scale`: x quantised by the recipe (None: quantised here; the caller passes them when sibling
    projections share one input). Forward: xq @ wq^T with both scales. x's gradient: row-wise, (dY * s_w^T)
    quantised per row times wq (the algebra of `Fp8LinearFunction`); tensor-wise, dY quantised whole times wq, both
    scales after the product. W's gradient stays in x's dtype: it feeds the optimizer's update directly, and rounding
    it to e4m3 would put a few percent of noise into every step's update (the output and x's gradient only pass
    through the network, where the noise averages over the width). Kept for the backward: x (as any linear keeps it),
    wq and its scales."""

    @staticmethod
    def forward(ctx, x, weight, bias, wq, w_scale, recipe: str, xq=None, x_scale=None, emulate: bool = False):
        if xq is None:
            xq, x_scale = quantise(x, recipe)
        out = fp8_matmul(xq, x_scale, wq, w_scale, x.dtype, emulate)
        if bias is not None:
            out = out.add_(bias.to(out.dtype))
        ctx.save_for_backward(x, wq, w_scale)
        ctx.recipe, ctx.emulate = recipe, emulate
        return out

    @staticmethod
    def backward(ctx, g):
        x, wq, w_scale = ctx.saved_tensors
        g = g.contiguous()
        g_x = g_w = g_b = None
        if ctx.needs_input_grad[0]:
            if ctx.recipe == "rowwise":
                g_x = fp8_linear_input_grad(g, wq, w_scale, ctx.emulate)
            else:
                gq, g_scale = quantise_tensorwise(g)
                g_x = fp8_matmul(gq, g_scale, wq.t().contiguous(), w_scale, g.dtype, ctx.emulate)
        if ctx.needs_input_grad[1]:
            g_w = (g.t() @ x.to(g.dtype)).to(x.dtype)
        if ctx.needs_input_grad[2]:
            g_b = g.sum(0)
        return g_x, g_w, g_b, None, None, None, None, None, None
