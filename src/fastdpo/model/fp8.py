"""The FP8 base of LoRA (--fp8_base): the frozen projections of the decoder layers held in FP8 (e4m3 with one float32
scale per output row), their products in FP8 (`fastdpo.kernels.fp8`).

Each `nn.Linear` named q/k/v/o/gate/up/down_proj stays an `nn.Linear` (PEFT wraps it as usual, and the fused LoRA
path of `fastdpo.model.lora` runs it as "another base": the base's output from its own forward, the adapter added
by `LoraAddFunction`), but its `weight` becomes the e4m3 tensor, a `weight_scale` buffer holds the row scales, and
its forward runs `Fp8LinearFunction`. The bfloat16 weight is dropped: the base takes half its bytes. Embeddings,
norms and the output head keep their dtype. Conversion happens before LoRA wraps the model and before any reference
log-prob is computed, so the reference (the adapters off, or precomputed) runs on the same FP8 base as the policy:
their log-ratio is exactly 0 at step 0.

The FP8 weights are never saved: a LoRA run saves its adapters only, and those apply to the original base."""

from __future__ import annotations

import types

import torch

from fastdpo.errors import FastDPOError
from fastdpo.kernels.fp8 import E4M3, Fp8LinearFunction, quantise_rowwise

FP8_PROJECTIONS = frozenset({"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"})
FP8_CAPABILITY = (8, 9)  # FP8 tensor cores: Ada (8.9) and Hopper (9.0) on


def is_fp8_linear(m) -> bool:
    """Whether `m` is a linear layer converted by `convert_to_fp8_base`."""
    return isinstance(m, torch.nn.Linear) and m.weight.dtype == E4M3 and "_fastdpo_fp8" in m.__dict__


def _fp8_forward(self, x: torch.Tensor) -> torch.Tensor:
    flat = x.reshape(-1, x.shape[-1])
    out = Fp8LinearFunction.apply(flat, self.weight, self.weight_scale, self.bias)
    return out.view(*x.shape[:-1], out.shape[-1])


def _projection(name: str) -> bool:
    """A module path names a decoder projection: its last part (or the part before PEFT's `base_layer`)."""
    parts = name.split(".")
    if parts[-1] == "base_layer" and len(parts) > 1:
        parts = parts[:-1]
    return parts[-1] in FP8_PROJECTIONS


@torch.no_grad()
def _convert(linear: torch.nn.Linear) -> None:
    w = linear.weight
    wq, scale = quantise_rowwise(w)
    linear.compute_dtype = w.dtype  # PEFT puts the adapters in this dtype (not in the weight's, which is FP8)
    linear.weight = torch.nn.Parameter(wq, requires_grad=False)  # the last reference to the old weight: freed
    linear.register_buffer("weight_scale", scale, persistent=False)
    if linear.bias is not None:
        linear.bias.requires_grad_(False)
    linear._fastdpo_fp8 = True
    linear.forward = types.MethodType(_fp8_forward, linear)


def convert_to_fp8_base(model: torch.nn.Module) -> int:
    """Hold every decoder projection of `model` (q/k/v/o and gate/up/down, under a PEFT wrapper too) in FP8 with
    row-wise scales and run its products in FP8; the embeddings, norms and output head are left as they are.
    Idempotent; returns how many linears it converted (0 when called again)."""
    n = 0
    for name, m in model.named_modules():
        if type(m) is torch.nn.Linear and _projection(name) and not is_fp8_linear(m):
            _convert(m)
            n += 1
    return n


def check_fp8_device(device: torch.device) -> None:
    """--fp8_base trains on a CUDA GPU with FP8 tensor cores (compute capability 8.9 or newer); refused elsewhere."""
    if device.type != "cuda":
        raise FastDPOError(f"--fp8_base needs a CUDA GPU with FP8 tensor cores (Ada or Hopper, compute capability "
                           f"8.9 or newer); this run trains on {device}. Drop --fp8_base (plain --train_type lora).")
    cap = torch.cuda.get_device_capability(device)
    if cap < FP8_CAPABILITY:
        name = torch.cuda.get_device_name(device)
        raise FastDPOError(f"--fp8_base: {name} has compute capability {cap[0]}.{cap[1]}, and FP8 matrix products "
                           "need 8.9 or newer (Ada: L4, L40S, RTX 4090; Hopper: H100, H200). Drop --fp8_base (plain "
                           "--train_type lora, or --train_type qlora for a smaller base).")
