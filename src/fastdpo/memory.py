"""Activation checkpointing policies (DESIGN §7): none, full (per decoder layer), ffn (MLP only), attn (attention
only), every:K (every K-th decoder layer). Non-reentrant, so keyword inputs and frozen inputs work."""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from fastdpo.config import checkpoint_policy


def _wrap(module: torch.nn.Module) -> None:
    if getattr(module, "_fastdpo_ckpt", False):
        return
    forward = module.forward

    def checkpointed(*args, **kwargs):
        if not (torch.is_grad_enabled() and module.training):
            return forward(*args, **kwargs)
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    module.forward = checkpointed
    module._fastdpo_ckpt = True


def _unwrap(module: torch.nn.Module) -> None:
    if getattr(module, "_fastdpo_ckpt", False):
        del module.forward
        module._fastdpo_ckpt = False


def decoder_layers(model) -> list[torch.nn.Module]:
    from fastdpo.model import decoder

    return list(decoder(model).layers)


def apply_checkpointing(model, policy: str) -> list[str]:
    """Wrap modules per `policy`; returns the names of what got wrapped (for logs and tests)."""
    name, k = checkpoint_policy(policy)
    layers = decoder_layers(model)
    wrapped = []
    for i, layer in enumerate(layers):
        for m in (layer, getattr(layer, "mlp", None), getattr(layer, "self_attn", None)):
            if m is not None:
                _unwrap(m)
        if name == "full" or (name == "every" and i % k == 0):
            _wrap(layer)
            wrapped.append(f"layers.{i}")
        elif name == "ffn":
            _wrap(layer.mlp)
            wrapped.append(f"layers.{i}.mlp")
        elif name == "attn":
            _wrap(layer.self_attn)
            wrapped.append(f"layers.{i}.self_attn")
    return wrapped


def compile_layers(model) -> None:
    """Regional compilation: each decoder layer through torch.compile (one compiled graph reused by all layers)."""
    for layer in decoder_layers(model):
        layer.compile(dynamic=False)  # static token budget: one graph, built once
