"""FP8 matrix products in the decoder projections (`fastdpo.kernels.fp8`): the FP8 base of LoRA (--fp8_base), and FP8
training of a full fine-tune (--fp8, `convert_to_fp8_training`, at the end).

The FP8 base: the frozen projections of the decoder layers held in FP8 (e4m3 with one float32 scale per output row),
their products in FP8.

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
from fastdpo.kernels.fp8 import (
    E4M3,
    RECIPES,
    Fp8LinearFunction,
    Fp8TrainLinearFunction,
    keep_quantised,
    kept_quantised,
    quantise,
    quantise_rowwise,
)

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


def check_fp8_device(device: torch.device, flag: str = "--fp8_base") -> None:
    """FP8 (--fp8_base, --fp8) trains on a CUDA GPU with FP8 tensor cores (compute capability 8.9 or newer); refused
    elsewhere."""
    instead = "plain --train_type lora" if flag == "--fp8_base" else "bf16 training"
    if device.type != "cuda":
        raise FastDPOError(f"{flag} needs a CUDA GPU with FP8 tensor cores (Ada or Hopper, compute capability "
                           f"8.9 or newer); this run trains on {device}. Drop {flag} ({instead}).")
    cap = torch.cuda.get_device_capability(device)
    if cap < FP8_CAPABILITY:
        name = torch.cuda.get_device_name(device)
        other = ", or --train_type qlora for a smaller base" if flag == "--fp8_base" else ""
        raise FastDPOError(f"{flag}: {name} has compute capability {cap[0]}.{cap[1]}, and FP8 matrix products "
                           f"need 8.9 or newer (Ada: L4, L40S, RTX 4090; Hopper: H100, H200). Drop {flag} "
                           f"({instead}{other}).")


# ------------------------------------------------------------------------------------------------- FP8 training

def is_fp8_trained(m) -> bool:
    """Whether `m` is a linear layer converted by `convert_to_fp8_training`."""
    return isinstance(m, torch.nn.Linear) and "_fastdpo_fp8_recipe" in m.__dict__


def _shared_input(x: torch.Tensor, flat: torch.Tensor, recipe: str, siblings: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`flat` (x as rows) quantised by `recipe`, computed once for the `siblings` projections that read the same `x`
    (q, k and v read one normed input; gate and up another), or by the kernel that wrote x (`keep_quantised`)."""
    kept = kept_quantised(x, recipe)
    if kept is not None:
        return kept
    xq, scale = quantise(flat, recipe)
    keep_quantised(x, recipe, xq, scale, siblings - 1)
    return xq, scale


def _weight_fp8(self) -> tuple[torch.Tensor, torch.Tensor]:
    """The weight quantised by the layer's recipe: at every call for a weight that trains (the optimizer moves it
    between steps), once for a frozen one (a reference's copy), kept while it is the same storage and version."""
    w, recipe = self.weight, self._fastdpo_fp8_recipe
    if w.requires_grad:
        return quantise(w.detach(), recipe)
    key = (w.data_ptr(), w._version, w.device)
    memo = self.__dict__.get("_fastdpo_fp8_weight")
    if memo is None or memo[0] != key:
        memo = (key, *quantise(w.detach(), recipe))
        self._fastdpo_fp8_weight = memo
    return memo[1], memo[2]


def _fp8_train_forward(self, x: torch.Tensor) -> torch.Tensor:
    recipe = self._fastdpo_fp8_recipe
    flat = x.reshape(-1, x.shape[-1])
    xq, x_scale = _shared_input(x, flat, recipe, self._fastdpo_fp8_siblings)
    wq, w_scale = _weight_fp8(self)
    out = Fp8TrainLinearFunction.apply(flat, self.weight, self.bias, wq, w_scale, recipe, xq, x_scale)
    return out.view(*x.shape[:-1], out.shape[-1])


# the plain pre-norm decoder layers (`h = h + attn(norm(h)); h = h + mlp(norm(h))`): their two norms feed projections
# directly (q/k/v; gate/up), whose kernels with row-wise scales write their output in e4m3 too, and their MLP's output
# goes straight into the residual sum, where nothing keeps it for the backward (`fastdpo.model.fused`); others (OLMo 2's
# post-feed-forward norm, MoE routing weights) do neither
PRE_NORM_LAYERS = frozenset({"LlamaDecoderLayer", "MistralDecoderLayer", "Qwen2DecoderLayer", "Qwen3DecoderLayer"})
# the projections that read one input: the attention's normed input, the MLP's normed input
SIBLINGS = ({"q_proj", "k_proj", "v_proj"}, {"gate_proj", "up_proj"})


def convert_to_fp8_training(model: torch.nn.Module, recipe: str = "rowwise") -> int:
    """Run every decoder projection of `model` (q/k/v/o, gate/up/down) as an FP8 product (--fp8): its weight stays a
    parameter in its dtype (the optimizer updates it as before) and is quantised at each forward by `recipe`
    (`rowwise`: a scale per output row and per token; `tensorwise`: one per tensor); the output and x's gradient
    are FP8 products, the weight's gradient is not (`Fp8TrainLinearFunction`). The embeddings, norms, attention and
    output head keep their dtype. In the layers of `PRE_NORM_LAYERS` the norms and the MLP's product are marked
    for their kernels to write their output in e4m3 too (row-wise), so those inputs are never quantised apart.
    Applied to the policy and to its frozen reference copy alike, so both compute the same products at step 0.
    Idempotent; returns how many linears it converted."""
    if recipe not in RECIPES:
        raise FastDPOError(f"--fp8_recipe must be one of {', '.join(RECIPES)}, got {recipe!r}.")
    n = 0
    for name, m in model.named_modules():
        if type(m) is torch.nn.Linear and _projection(name) and not is_fp8_linear(m) and not is_fp8_trained(m):
            m._fastdpo_fp8_recipe = recipe
            last = name.split(".")[-2 if name.endswith("base_layer") else -1]
            m._fastdpo_fp8_siblings = next((len(group) for group in SIBLINGS if last in group), 1)
            m.forward = types.MethodType(_fp8_train_forward, m)
            n += 1
    for m in model.modules():  # the kernels that write these products' inputs quantise them as they write them
        if type(m).__name__ in PRE_NORM_LAYERS:
            readers = [sum(is_fp8_trained(getattr(part, p, None)) for p in group)
                       for part, group in ((m.self_attn, SIBLINGS[0]), (m.mlp, SIBLINGS[1]))]
            readers.append(int(is_fp8_trained(getattr(m.mlp, "down_proj", None))))
            for part, k in zip((m.input_layernorm, m.post_attention_layernorm, m.mlp), readers):
                part._fastdpo_fp8_out = (recipe, k)
    return n
