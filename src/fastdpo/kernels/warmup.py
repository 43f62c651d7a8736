"""Building a model's kernels ahead of its first step: on a background thread, while the run reads data and loads
weights, every kernel launch the model trains with runs once on tiny inputs, so that Triton compiles (or loads) each
kernel before the first forward needs it. On a machine with empty caches the builds take several seconds; a build
that fails turns the kernels off (`ready` says why), and training keeps the model's own layers."""

from __future__ import annotations

import functools
import threading

import torch

from fastdpo.kernels.fp8 import quantise_rowwise
from fastdpo.kernels.gather_rows import gather_rows_backward
from fastdpo.kernels.launch import DTYPES, HAVE_TRITON, INTERPRET, turn_off, why_off
from fastdpo.kernels.logprob_head import logp_backward_, logp_forward
from fastdpo.kernels.lora import LORA_MAX_RANK, lora_dropout_down, lora_dropout_input_grad, lora_dropout_weight_grad
from fastdpo.kernels.rms_norm import rms_norm_backward, rms_norm_forward, rms_norm_forward_fp8
from fastdpo.kernels.rope import rope
from fastdpo.kernels.swiglu import silu_mul, silu_mul_backward, silu_mul_fp8


def _text_config(config):
    return getattr(config, "text_config", None) or config


def head_size(config) -> int | None:
    """The attention head size of a model's config (what its rotary embedding rotates)."""
    text = _text_config(config)
    hidden, heads = getattr(text, "hidden_size", None), getattr(text, "num_attention_heads", None)
    return getattr(text, "head_dim", None) or (hidden // heads if hidden and heads else None)


# vision-language models whose vision tower normalises with RMSNorm (its blocks and its merger), which the fused norms
# serve as they serve the language model's: the tower's width is built too
RMS_NORM_VISION = ("qwen2_5_vl",)


def norm_widths(config) -> list[int]:
    """The widths a model's norms take: the hidden size, the head size (Qwen3's per-head query and key norms), and a
    vision tower's width where its norms are RMSNorms (`RMS_NORM_VISION`)."""
    hidden = getattr(_text_config(config), "hidden_size", None)
    if not hidden:
        return []
    head_dim = head_size(config)
    vision = getattr(config, "vision_config", None) if getattr(config, "model_type", None) in RMS_NORM_VISION else None
    tower = getattr(vision, "hidden_size", None)
    return list(dict.fromkeys([hidden] + ([head_dim] if head_dim else []) + ([tower] if tower else [])))


_builds: dict[tuple, threading.Thread] = {}


def _launches(widths: list[int], dtype: torch.dtype, device: torch.device, head_dim: int | None,
              lora: bool | None, dropout_rank: int = 0, fp8: bool = False, fp8_base: bool = False) -> list:
    """Every kernel launch a model of these norm widths and head size trains with, as thunks on tiny inputs: each
    builds its kernel as training would (the same dtypes, constants and specialisations). `lora`: True (LoRA: the
    norms' weights are frozen), False (full fine-tuning: they train, and the down projections are plain), None (both
    kinds). `dropout_rank`: the rank of LoRA adapters trained with dropout, whose kernels are built too (0: none).
    `fp8`: the norm and SwiGLU kernels that also write their output in e4m3 (--fp8, row-wise scales) are built too,
    and the row-wise quantisation's (weights, gradients, attention's output); `fp8_base`: the row-wise
    quantisation's alone (--fp8_base: the base's weights, the activations and gradients of its products).
    A launch left out only means its kernel is built when first used."""
    z = functools.partial(torch.zeros, dtype=dtype, device=device)
    grads = (False,) if lora else (True,) if lora is False else (True, False)
    # a plain down projection, or one LoRA wraps or that runs as an FP8 product (--fp8)
    products = (True,) if lora is False and not fp8 else (True, False)
    out = []
    for n in widths:
        x, w, r = z(2, n), z(n) + 1, torch.ones(2, dtype=torch.float32, device=device)
        out.append(functools.partial(rms_norm_forward, x, w, 1e-6))
        out += [functools.partial(rms_norm_backward, x, x, w, r, g) for g in grads]
        if fp8:
            out.append(functools.partial(rms_norm_forward_fp8, x, w, 1e-6))
    if fp8 or fp8_base:  # rows in e4m3, and rows times column scales (an input gradient's)
        ones = torch.ones(1, 16, dtype=torch.float32, device=device)
        out += [functools.partial(quantise_rowwise, z(2, 16)), functools.partial(quantise_rowwise, z(2, 16),
                                                                                 col_scale=ones)]
    a = z(16)
    out.append(functools.partial(silu_mul, a, a))
    if fp8:  # the MLP's product as rows, in e4m3
        out.append(functools.partial(silu_mul_fp8, z(2, 16), z(2, 16)))
    out += [functools.partial(silu_mul_backward, a, a, a, p) for p in products]
    logits, t, f = z(2, 16), torch.zeros(2, dtype=torch.long, device=device), torch.zeros(2, device=device)
    out += [functools.partial(logp_forward, logits, t, 1.0), functools.partial(logp_backward_, logits, t, f, f, 1.0)]
    idx = torch.zeros(2, dtype=torch.long, device=device)
    out.append(functools.partial(gather_rows_backward, z(2, 16), idx, idx - 1))
    if head_dim and head_dim % 2 == 0:  # the projections' layout: (B, S, H, D) seen as (B, H, S, D)
        q, c = z(1, 3, 2, head_dim).transpose(1, 2), z(1, 3, head_dim)
        out += [functools.partial(rope, q, c, c, b) for b in (False, True)]
    if 0 < dropout_rank <= LORA_MAX_RANK:  # widths that are multiples of 16 (Triton specialises on it), as models'
        x, a, gt = z(2, 64), z(dropout_rank, 64), z(2, dropout_rank)
        out += [functools.partial(lora_dropout_down, x, a, 1, 0.5),
                functools.partial(lora_dropout_input_grad, gt, a, 1, 0.5, 1.0),
                functools.partial(lora_dropout_weight_grad, gt, x, 1, 0.5)]
    return out


def _build(widths: list[int], dtype: torch.dtype, device: torch.device, head_dim: int | None, lora: bool | None,
           dropout_rank: int = 0, fp8: bool = False, fp8_base: bool = False) -> None:
    """Run the launches of `_launches` once."""
    for launch in _launches(widths, dtype, device, head_dim, lora, dropout_rank, fp8, fp8_base):
        launch()
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def build_ahead(widths: list[int], dtype: torch.dtype, device: torch.device, head_dim: int | None = None,
                lora: bool | None = None, dropout_rank: int = 0, fp8: bool = False,
                fp8_base: bool = False) -> threading.Thread | None:
    """Build every kernel a model of these norm `widths`, `head_dim` and `dtype` trains with (`lora` and
    `dropout_rank`, `fp8`, `fp8_base`: see `_launches`), on a background thread, while the main thread reads data
    and loads weights: on a machine with empty caches the builds (and Triton's launcher code for each) take several
    seconds, which the first forward would otherwise wait for. `ready` waits for it and tells whether the kernels can be used."""
    if not HAVE_TRITON or dtype not in DTYPES or not (device.type == "cuda" or (INTERPRET and device.type == "cpu")):
        return None
    key = (tuple(widths), dtype, str(device), head_dim, lora, dropout_rank, fp8, fp8_base)
    if key in _builds:
        return _builds[key]

    def build() -> None:
        try:
            if device.type == "cuda":
                with torch.cuda.device(device):
                    _build(widths, dtype, device, head_dim, lora, dropout_rank, fp8, fp8_base)
            else:
                _build(widths, dtype, device, head_dim, lora, dropout_rank, fp8, fp8_base)
        except Exception as e:  # noqa: BLE001 - any failure means: do not use them; `ready` says why
            turn_off(f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")

    thread = threading.Thread(target=build, name="fastdpo-kernel-builds", daemon=True)
    _builds[key] = thread
    thread.start()
    return thread


def ready(widths: list[int], dtype: torch.dtype, device: torch.device, head_dim: int | None = None,
          lora: bool | None = None, dropout_rank: int = 0, fp8: bool = False, fp8_base: bool = False) -> str | None:
    """Wait until the kernels for these widths are built (by `build_ahead`'s thread, or now); None when they serve,
    else why not (after which `available` says no)."""
    thread = build_ahead(widths, dtype, device, head_dim, lora, dropout_rank, fp8, fp8_base)
    if thread is None:
        return "Triton is not installed, or the device or dtype is not one the kernels serve"
    thread.join()
    return why_off()

