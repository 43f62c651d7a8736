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

Served: one active adapter of plain LoRA (no DoRA or other variant, no bias on B), not merged, in a module whose
dropout is off or an `nn.Dropout`. Everything else (adapters disabled, as the reference's forward runs, merged weights, several
adapters, per-row adapter names, a compiled region) runs PEFT's own forward.
"""

from __future__ import annotations

import types

import torch

from fastdpo.model import kernels
from fastdpo.model.logprobs import has_out_dtype


def _weight_grad(a: torch.Tensor, b: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """scale * a @ b in `dtype` (an adapter's float32 gradient from bfloat16 factors: written by the GEMM in float32
    on CUDA, where torch offers that)."""
    if a.is_cuda and a.dtype != dtype and dtype == torch.float32 and has_out_dtype():
        out = torch.mm(a, b, out_dtype=torch.float32)
    else:
        out = (a @ b).to(dtype)
    return out.mul_(scale) if scale != 1.0 else out


class _LoraAdd(torch.autograd.Function):
    """y + scale * (dropout(x) @ A^T) @ B^T for 2-D x (N, in) and the base's y (N, out)."""

    @staticmethod
    def forward(ctx, x, y, A, B, scale: float, p: float):
        a_w, b_w = A.to(x.dtype), B.to(x.dtype)
        mask = seed = None
        if p > 0 and kernels.lora_dropout_serves(x, a_w.shape[0]):
            seed = kernels.lora_dropout_seed()  # the masks: drawn in each kernel from it, never stored
            t = kernels.lora_dropout_down(x, a_w, seed, p)
        else:
            xd = x
            if p > 0:
                mask = torch.empty_like(x, dtype=torch.bool).bernoulli_(1.0 - p)
                xd = x * mask * (1.0 / (1.0 - p))
            t = xd @ a_w.t()  # (N, r)
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
            if seed is not None:
                g_x = kernels.lora_dropout_input_grad(gt, a_w, seed, p, scale)
            else:
                g_x = torch.mm(gt, a_w)
                g_x = g_x.mul_(scale) if mask is None else g_x.mul_(mask).mul_(scale / (1.0 - p))
        if ctx.needs_input_grad[2]:
            if seed is not None:
                g_a = kernels.lora_dropout_weight_grad(gt, x, seed, p)
                g_a = (g_a.mul_(scale) if scale != 1.0 else g_a).to(ctx.dtypes[0])
            else:
                xd = x if mask is None else x * mask * (1.0 / (1.0 - p))
                g_a = _weight_grad(gt.t(), xd, scale, ctx.dtypes[0])
        if ctx.needs_input_grad[3]:
            g_b = _weight_grad(g.t(), t, scale, ctx.dtypes[1])
        return g_x, g, g_a, g_b, None, None


def _dropout_p(module) -> float | None:
    """The dropout probability a LoRA module applies in this call (0 when off or evaluating), None for a kind of
    dropout this forward does not reproduce."""
    if isinstance(module, torch.nn.Identity):
        return 0.0
    if type(module) is torch.nn.Dropout:
        return module.p if module.training else 0.0
    return None


def _lora_forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    plain = self._fastdpo_plain_forward
    if args or kwargs or self.disable_adapters or self.merged or torch.compiler.is_compiling():
        return plain(x, *args, **kwargs)
    active = [a for a in self.active_adapters if a in self.lora_A.keys()]
    if len(active) != 1 or active[0] in getattr(self, "lora_variant", {}) or getattr(self, "use_dora", {}).get(
            active[0], False):
        return plain(x)
    name = active[0]
    p = _dropout_p(self.lora_dropout[name])
    a, b = self.lora_A[name], self.lora_B[name]
    if p is None or not x.is_floating_point() or getattr(a, "bias", None) is not None or getattr(
            b, "bias", None) is not None:  # a bias on B (PEFT's lora_bias): its own forward
        return plain(x)
    y = self.base_layer(x)
    if y.dtype != x.dtype:
        return plain(x)
    shape = y.shape
    out = _LoraAdd.apply(x.reshape(-1, x.shape[-1]), y.reshape(-1, shape[-1]), a.weight, b.weight,
                         float(self.scaling[name]), p)
    return out.view(shape)


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
