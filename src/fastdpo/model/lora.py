"""A lean forward for PEFT's LoRA linear layers: base(x) + s * dropout(x) @ A^T @ B^T in three GEMMs and no extra
pass over the output.

PEFT's forward casts x to the adapter's dtype (float32 for a bfloat16 model: a copy of x, saved for the backward,
once per projection, so q, k and v keep three), multiplies B's output by the scaling and adds it to the base's:
passes over the layer's output as wide as the projection (12,288 columns for an 8B model's MLP). Here the adapter's
product is computed in the input's dtype with float32 accumulation, and the base output is added in the second
GEMM's epilogue (`addmm`); only x (shared by q, k and v) and x @ A^T (rank columns) are kept for the backward, and
the adapters' gradients come out in their own dtype. Numerically: the same sum, rounded once to the output dtype,
with A and B read in the input's dtype.

With dropout, where the Triton kernels serve (CUDA), dropout(x) is never written: one kernel applies the mask in
registers on the way into x @ A^T, and the backward's two kernels draw the same mask again (Philox keyed by a seed
from torch's generator and each element's index) for x's and A's gradients. Elsewhere the mask is drawn by
`bernoulli_`, kept for the backward, and applied by torch.

Where the linear is a lean SwiGLU MLP's down projection (`fastdpo.model.fused`), the product silu(gate) * up and
the projection are one autograd function: gate and up are kept, as the MLP keeps them anyway, and the product is
rebuilt in the backward instead of being kept for A's gradient (a sixth of a layer's bytes on an 8B model).

Served: one active adapter of plain LoRA (no DoRA or other variant, no bias on B), not merged, in a module whose
dropout is off or an `nn.Dropout`. Everything else (adapters disabled, as the reference's forward runs, merged weights, several
adapters, per-row adapter names, a compiled region) runs PEFT's own forward.
"""

from __future__ import annotations

import math
import types

import torch
import torch.nn.functional as F

from fastdpo.model import kernels
from fastdpo.model.logprobs import has_out_dtype

# DoRA rescales each output row by a trained magnitude over the norm of W + s B A, which the lean forward's GEMMs
# do not compute: its layers keep PEFT's forward (`_served`)
DORA_NOTE = ("--use_dora true: DoRA adapters train through PEFT's own forward, not the fused LoRA path (which serves "
             "plain LoRA only): steps are slower and hold more memory than plain LoRA's; the reference is the model "
             "with the adapters off, as for LoRA.")


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
    if p > 0 and kernels.lora_dropout_serves(x, a_w.shape[0]):
        seed = kernels.lora_dropout_seed()  # the masks: drawn in each kernel from it, never stored
        return kernels.lora_dropout_down(x, a_w, seed, p), None, seed
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
        g_x = kernels.lora_dropout_input_grad(gt, a_w, seed, p, scale)
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
        g_a = kernels.lora_dropout_weight_grad(gt, x, seed, p)
        return (g_a.mul_(scale) if scale != 1.0 else g_a).to(dtype)
    xd = x if mask is None else x * mask * (1.0 / (1.0 - p))
    return _weight_grad(gt.t(), xd, scale, dtype)


class _LoraLinear(torch.autograd.Function):
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


class _LoraAdd(torch.autograd.Function):
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


class _SiluMulLoraDown(torch.autograd.Function):
    """A SwiGLU MLP's end through a LoRA down projection over a frozen base weight W (no bias), for 2-D gate and up
    (N, inter): h = silu(gate) * up, then h @ W^T + scale * (dropout(h) @ A^T) @ B^T.

    Keeps gate, up and h @ A^T (rank columns), not h (off the kernels, dropout's mask too, a byte per element): the
    backward rebuilds h in the same pass that takes the product's gradients (as the plain down projection's does),
    which saves a third of what a layer's MLP keeps. In a checkpointed region's recompute whose output only joins the
    residual stream (`skip`), the base GEMM, whose output nothing keeps, is not run: the output is left unwritten."""

    @staticmethod
    def forward(ctx, gate, up, W, A, B, scale: float, p: float, fast: bool, skip: bool):
        a_w, b_w = A.to(gate.dtype), B.to(gate.dtype)
        h = kernels.silu_mul(gate, up) if fast else F.silu(gate) * up
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
            g_gate, g_up, h = kernels.silu_mul_backward(gate, up, g_h, product=want_a)
        else:
            h = F.silu(gate) * up if want_a else None
            g_gate, g_up = kernels.silu_mul_grads_torch(gate, up, g_h)
        g_a = _adapter_a_grad(gt, h, scale, p, seed, mask, ctx.dtypes[0]) if want_a else None
        g_b = _weight_grad(g.t(), t, scale, ctx.dtypes[1]) if ctx.needs_input_grad[4] else None
        return g_gate, g_up, None, g_a, g_b, None, None, None, None


def _dropout_p(module) -> float | None:
    """The dropout probability a LoRA module applies in this call (0 when off or evaluating), None for a kind of
    dropout this forward does not reproduce."""
    if isinstance(module, torch.nn.Identity):
        return 0.0
    if type(module) is torch.nn.Dropout:
        return module.p if module.training else 0.0
    return None


def _served(self, x: torch.Tensor) -> tuple[str, float] | None:
    """(adapter name, dropout probability) when the lean forward serves this call of LoRA layer `self`, else None."""
    if self.disable_adapters or self.merged or torch.compiler.is_compiling() or not x.is_floating_point():
        return None
    active = [a for a in self.active_adapters if a in self.lora_A.keys()]
    if len(active) != 1 or active[0] in getattr(self, "lora_variant", {}) or getattr(self, "use_dora", {}).get(
            active[0], False):
        return None
    name = active[0]
    p = _dropout_p(self.lora_dropout[name])
    a, b = self.lora_A[name], self.lora_B[name]
    if p is None or getattr(a, "bias", None) is not None or getattr(b, "bias", None) is not None:
        return None  # a bias on B (PEFT's lora_bias): its own forward
    return name, p


def _lora_forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    plain = self._fastdpo_plain_forward
    served = None if args or kwargs else _served(self, x)
    if served is None:
        return plain(x, *args, **kwargs)
    name, p = served
    base = self.base_layer
    if plain_frozen_linear(base, x):
        flat = x.reshape(-1, x.shape[-1])
        out = _LoraLinear.apply(flat, base.weight, base.bias, self.lora_A[name].weight, self.lora_B[name].weight,
                                float(self.scaling[name]), p)
        return out.view(*x.shape[:-1], out.shape[-1])
    y = base(x)
    if y.dtype != x.dtype:
        return plain(x)
    shape = y.shape
    out = _LoraAdd.apply(x.reshape(-1, x.shape[-1]), y.reshape(-1, shape[-1]), self.lora_A[name].weight,
                         self.lora_B[name].weight, float(self.scaling[name]), p)
    return out.view(shape)


def plain_frozen_linear(base, x: torch.Tensor) -> bool:
    """Whether LoRA's base layer is a plain `nn.Linear` whose frozen weight (and bias) are of x's dtype: then the
    lean forward runs its GEMMs too."""
    return (type(base) is torch.nn.Linear and not base.weight.requires_grad and base.weight.dtype == x.dtype
            and (base.bias is None or (not base.bias.requires_grad and base.bias.dtype == x.dtype)))


def silu_mul_down(layer, gate: torch.Tensor, up: torch.Tensor, fast: bool, skip: bool) -> torch.Tensor | None:
    """layer(silu(gate) * up) for a LoRA down projection `layer` that the lean forward serves, with the product
    rebuilt in the backward rather than kept (`_SiluMulLoraDown`; `fast`: the Triton kernels, `skip`: a recompute
    whose output nothing keeps); None where it does not serve (then call the layer on the product)."""
    if "_fastdpo_plain_forward" not in layer.__dict__:
        return None
    served = _served(layer, gate)
    base = getattr(layer, "base_layer", None)
    if served is None or not plain_frozen_linear(base, gate) or base.bias is not None or up.dtype != gate.dtype:
        return None
    name, p = served
    shape = gate.shape
    out = _SiluMulLoraDown.apply(gate.reshape(-1, shape[-1]), up.reshape(-1, shape[-1]), base.weight,
                                 layer.lora_A[name].weight, layer.lora_B[name].weight, float(layer.scaling[name]), p,
                                 fast, skip)
    return out.view(*shape[:-1], out.shape[-1])


def fuse_lora(model: torch.nn.Module) -> int:
    """Give each of `model`'s PEFT LoRA linear layers the lean forward (idempotent); returns how many."""
    try:
        from peft.tuners.lora.layer import Linear
    except ImportError:
        return 0
    n = 0
    for m in model.modules():
        if type(m) is not Linear or not isinstance(getattr(m, "base_layer", None), torch.nn.Linear):
            continue
        if "_fastdpo_plain_forward" not in m.__dict__:
            m._fastdpo_plain_forward = m.forward
            m.forward = types.MethodType(_lora_forward, m)
        n += 1
    return n
