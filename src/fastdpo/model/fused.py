"""Lean RMSNorm and SwiGLU for training: the same forward, fewer bytes kept for the backward.

transformers' RMSNorm casts its input to float32 and autograd keeps that copy, and the normalised bfloat16 result
too: six bytes per element beyond the input, for every norm (two per layer, plus Qwen3's per-head query and key
norms). Its SwiGLU MLP keeps the gate, the up projection, the activated gate and their product. Here the norm keeps
only its input and one float32 inverse RMS per row, and the MLP keeps the gate and up projections, recomputing the
activation and the product in the backward (a few elementwise kernels, against 30-45 % of a layer's activation
bytes on the Qwen3 shapes).

The forward runs the modules' own operations in their order, so its results are bit-identical; `fuse_layers`
checks that on a probe input for each module class before replacing its forward, and leaves a class whose forward
differs (e.g. Gemma's `1 + weight` norm) as it is. The backward is the analytic gradient, in float32 where the
original computes in float32."""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

log = logging.getLogger("fastdpo")


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        xf = x.to(torch.float32)
        rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        y = (xf * rstd).to(x.dtype)
        ctx.save_for_backward(x, weight, rstd)
        return weight * y

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight, rstd = ctx.saved_tensors
        n = x.to(torch.float32) * rstd
        g_weight = None
        if ctx.needs_input_grad[1]:
            g_weight = (grad * n.to(x.dtype)).reshape(-1, weight.shape[-1]).sum(0, dtype=torch.float32).to(weight.dtype)
        g_x = None
        if ctx.needs_input_grad[0]:
            g_n = (grad * weight).to(torch.float32)
            g_x = (rstd * (g_n - n * (g_n * n).mean(-1, keepdim=True))).to(x.dtype)
        return g_x, g_weight, None


def _silu_mul_grads(gate: torch.Tensor, up: torch.Tensor, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients of silu(gate) * up with respect to gate and up, in float32, returned in their dtypes."""
    gf = gate.to(torch.float32)
    s = torch.sigmoid(gf)
    g = grad.to(torch.float32)
    g_up = (g * (gf * s)).to(up.dtype)
    g_gate = (g * up.to(torch.float32) * s * (1 + gf * (1 - s))).to(gate.dtype)
    return g_gate, g_up


class _SiluMul(torch.autograd.Function):
    """silu(gate) * up, keeping gate and up only."""

    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(gate, up)
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        gate, up = ctx.saved_tensors
        return _silu_mul_grads(gate, up, grad)


class _SiluMulDown(torch.autograd.Function):
    """(silu(gate) * up) @ down.T for a plain down projection: the product is recomputed in the backward."""

    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(gate, up, down)
        return F.linear(F.silu(gate) * up, down)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        gate, up, down = ctx.saved_tensors
        p = F.silu(gate) * up
        g_down = None
        if ctx.needs_input_grad[2]:
            g_down = grad.reshape(-1, grad.shape[-1]).t() @ p.reshape(-1, p.shape[-1])
        g_gate, g_up = _silu_mul_grads(gate, up, grad @ down)
        return g_gate, g_up, g_down


def _norm_forward(module):
    def forward(hidden_states: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and module.training:
            return _RMSNorm.apply(hidden_states, module.weight, module.variance_epsilon)
        return module._fastdpo_plain_forward(hidden_states)
    return forward


def _plain_linear(m) -> bool:
    return type(m) is torch.nn.Linear and m.bias is None


def _mlp_forward(module):
    plain_down = _plain_linear(module.down_proj)

    def forward(x: torch.Tensor) -> torch.Tensor:
        if not (torch.is_grad_enabled() and module.training):
            return module._fastdpo_plain_forward(x)
        gate, up = module.gate_proj(x), module.up_proj(x)
        if plain_down:
            return _SiluMulDown.apply(gate, up, module.down_proj.weight)
        return module.down_proj(_SiluMul.apply(gate, up))
    return forward


def _is_norm(m) -> bool:
    return (type(m).__name__.endswith("RMSNorm") and isinstance(getattr(m, "weight", None), torch.Tensor)
            and m.weight.dim() == 1 and hasattr(m, "variance_epsilon"))


def _is_swiglu(m) -> bool:
    act = getattr(getattr(m, "config", None), "hidden_act", None)
    return (act == "silu" and all(hasattr(m, n) for n in ("gate_proj", "up_proj", "down_proj"))
            and isinstance(getattr(m, "act_fn", None), torch.nn.Module))


@torch.no_grad()
def _same_forward(module, replacement, width: int) -> bool:
    """The replacement's output equals the module's own, bit for bit, on a probe input (grad on, training)."""
    p = next(module.parameters())
    g = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(3, width, generator=g).to(device=p.device, dtype=p.dtype)
    was = module.training
    module.train()
    try:
        with torch.enable_grad():
            want = module._fastdpo_plain_forward(x)
            got = replacement(x)
    finally:
        module.train(was)
    return want.dtype == got.dtype and torch.equal(want, got)


def fuse_layers(model: torch.nn.Module) -> list[str]:
    """Give every RMSNorm and SwiGLU MLP of `model` the lean forward where it reproduces the module's own (checked
    once per class); returns the class names replaced. Idempotent."""
    done: dict[type, bool] = {}
    for m in model.modules():
        kind = "norm" if _is_norm(m) else "mlp" if _is_swiglu(m) else None
        if kind is None or hasattr(m, "_fastdpo_plain_forward"):
            continue
        m._fastdpo_plain_forward = m.forward
        replacement = _norm_forward(m) if kind == "norm" else _mlp_forward(m)
        if type(m) not in done:
            width = m.weight.shape[0] if kind == "norm" else m.gate_proj.in_features
            done[type(m)] = _same_forward(m, replacement, width)
            if not done[type(m)]:
                log.info("%s keeps its own forward (the lean one differs from it).", type(m).__name__)
        if done[type(m)]:
            m.forward = replacement
        else:
            del m._fastdpo_plain_forward
    return sorted(t.__name__ for t, ok in done.items() if ok)
