"""A lean forward for PEFT's LoRA linear layers: base(x) + s * dropout(x) @ A^T @ B^T in three GEMMs and no extra
pass over the output (the autograd Functions of `fastdpo.kernels.lora`; with dropout on CUDA, its kernels apply the
mask in registers).

Where the linear is a lean SwiGLU MLP's down projection (`fastdpo.model.fused`), the product silu(gate) * up and
the projection are one autograd function (`SiluMulLoraDownFunction`): gate and up are kept, as the MLP keeps them
anyway, and the product is rebuilt in the backward instead of being kept for A's gradient.

Served: one active adapter of plain LoRA (no DoRA or other variant, no bias on B), not merged, in a module whose
dropout is off or an `nn.Dropout`. Everything else (adapters disabled, as the reference's forward runs, merged weights, several
adapters, per-row adapter names, a compiled region) runs PEFT's own forward.
"""

from __future__ import annotations

import types

import torch

from fastdpo.kernels.lora import LoraAddFunction, LoraLinearFunction, SiluMulLoraDownFunction

# DoRA rescales each output row by a trained magnitude over the norm of W + s B A, which the lean forward's GEMMs
# do not compute: its layers keep PEFT's forward (`_served`)
DORA_NOTE = ("--use_dora true: DoRA adapters train through PEFT's own forward, not the fused LoRA path (which serves "
             "plain LoRA only): steps are slower and hold more memory than plain LoRA's; the reference is the model "
             "with the adapters off, as for LoRA.")


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
        out = LoraLinearFunction.apply(flat, base.weight, base.bias, self.lora_A[name].weight,
                                       self.lora_B[name].weight, float(self.scaling[name]), p)
        return out.view(*x.shape[:-1], out.shape[-1])
    y = base(x)
    if y.dtype != x.dtype:
        return plain(x)
    shape = y.shape
    out = LoraAddFunction.apply(x.reshape(-1, x.shape[-1]), y.reshape(-1, shape[-1]), self.lora_A[name].weight,
                                self.lora_B[name].weight, float(self.scaling[name]), p)
    return out.view(shape)


def plain_frozen_linear(base, x: torch.Tensor) -> bool:
    """Whether LoRA's base layer is a plain `nn.Linear` whose frozen weight (and bias) are of x's dtype: then the
    lean forward runs its GEMMs too."""
    return (type(base) is torch.nn.Linear and not base.weight.requires_grad and base.weight.dtype == x.dtype
            and (base.bias is None or (not base.bias.requires_grad and base.bias.dtype == x.dtype)))


def silu_mul_down(layer, gate: torch.Tensor, up: torch.Tensor, fast: bool, skip: bool) -> torch.Tensor | None:
    """layer(silu(gate) * up) for a LoRA down projection `layer` that the lean forward serves, with the product
    rebuilt in the backward rather than kept (`SiluMulLoraDownFunction`; `fast`: the Triton kernels, `skip`: a
    recompute whose output nothing keeps); None where it does not serve (then call the layer on the product)."""
    if "_fastdpo_plain_forward" not in layer.__dict__:
        return None
    served = _served(layer, gate)
    base = getattr(layer, "base_layer", None)
    if served is None or not plain_frozen_linear(base, gate) or base.bias is not None or up.dtype != gate.dtype:
        return None
    name, p = served
    shape = gate.shape
    out = SiluMulLoraDownFunction.apply(gate.reshape(-1, shape[-1]), up.reshape(-1, shape[-1]), base.weight,
                                        layer.lora_A[name].weight, layer.lora_B[name].weight,
                                        float(layer.scaling[name]), p, fast, skip)
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
