"""LoRA on the tiny models for the lean LoRA forward's tests: PEFT models with B drawn at random, one forward and
backward, and the dropout checked against the plain computation under a given mask."""

import torch
from peft import LoraConfig, get_peft_model

from fastdpo.model import lora
from fastdpo.model.load import load_model


def peft_model(model_dirs, dtype=torch.float32, dropout=0.0, lora_alpha=8, shape="qwen3", **kw):
    """A tiny model (`model_dirs(shape)`) with PEFT's LoRA on every linear layer (rank 4), B drawn at random."""
    torch.manual_seed(0)
    base = load_model(str(model_dirs(shape)), dtype, torch.device("cpu"))
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=lora_alpha, lora_dropout=dropout,
                                            target_modules="all-linear", **kw))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:  # PEFT starts B at zero, which would hide the adapter's product
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
    return model


def logits_and_grads(model, ids):
    """The logits (float32) and the gradients by parameter name of a fixed linear function of them."""
    model.zero_grad()
    logits = model(input_ids=ids, use_cache=False).logits.float()
    w = torch.linspace(-1, 1, logits.shape[-1])
    (logits * w).sum().backward()
    return logits.detach(), {n: p.grad.detach().float().clone() for n, p in model.named_parameters()
                             if p.grad is not None}


def ids_for(model):
    """A fixed (2, 11) batch of token ids in the model's vocabulary."""
    return torch.randint(4, model.config.vocab_size, (2, 11), generator=torch.Generator().manual_seed(2))


def check_dropout_under_mask(model_dirs, draw_mask, atol=1e-6):
    """A LoRA down projection with dropout 0.3 through the lean forward, from torch's seed 7: output and gradients
    equal the plain computation under the mask `draw_mask(x)` draws after the same seed. Returns the layer, its
    input and copies of A and B."""
    model = peft_model(model_dirs, dropout=0.3)
    layer = model.base_model.model.model.layers[0].mlp.down_proj
    assert lora.fuse_lora(model)
    model.train()
    x = torch.randn(5, layer.in_features, generator=torch.Generator().manual_seed(3), requires_grad=True)
    torch.manual_seed(7)
    out = layer(x)
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(4))
    gx, ga, gb = torch.autograd.grad((out * w).sum(), (x, layer.lora_A["default"].weight, layer.lora_B["default"].weight))

    torch.manual_seed(7)
    mask = draw_mask(x)
    assert not mask.all()
    xr = x.detach().clone().requires_grad_()
    a, b = (p.detach().clone().requires_grad_() for p in (layer.lora_A["default"].weight, layer.lora_B["default"].weight))
    ref = layer.base_layer(xr) + 2.0 * ((xr * mask / 0.7) @ a.t()) @ b.t()
    rx, ra, rb = torch.autograd.grad((ref * w).sum(), (xr, a, b))
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=atol)
    for got, want in ((gx, rx), (ga, ra), (gb, rb)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=atol)
    return layer, x, a, b


def mlp_lora_model(model_dirs, dropout=0.0, targets="all-linear", fused=True, use_kernels=False):
    """Qwen3 tiny in float32 with LoRA as training builds it: the lean MLPs first (`fuse_layers`, on the Triton
    kernels with `use_kernels`), then PEFT's adapters with B drawn at random, then (`fused`) the lean LoRA forward."""
    from fastdpo.model.fused import fuse_layers

    torch.manual_seed(0)
    base = load_model(str(model_dirs("qwen3")), torch.float32, torch.device("cpu"))
    if fused:
        assert "Qwen3MLP" in fuse_layers(base, use_kernels=use_kernels)
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, lora_dropout=dropout, target_modules=targets))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
    if fused:
        lora.fuse_lora(model)
    return model.train()  # the lean MLPs serve training's forward with grad


def check_mlp_dropout_under_mask(model_dirs, draw_mask, use_kernels=False, atol=1e-6):
    """A lean MLP whose LoRA down projection has dropout 0.3 (the only adapter), from torch's seed 7: output and
    gradients equal the plain computation under the mask `draw_mask(h)` draws after the same seed."""
    model = mlp_lora_model(model_dirs, dropout=0.3, targets=["down_proj"], use_kernels=use_kernels)
    model.train()
    mlp = model.base_model.model.model.layers[0].mlp
    down = mlp.down_proj
    x = torch.randn(2, 5, model.config.hidden_size, generator=torch.Generator().manual_seed(3), requires_grad=True)
    a, b = down.lora_A["default"].weight, down.lora_B["default"].weight
    torch.manual_seed(7)
    out = mlp(x)
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(4))
    got = torch.autograd.grad((out * w).sum(), (x, a, b))

    torch.manual_seed(7)
    xr = x.detach().clone().requires_grad_()
    ar, br = (p.detach().clone().requires_grad_() for p in (a, b))
    h = torch.nn.functional.silu(mlp.gate_proj(xr)) * mlp.up_proj(xr)
    mask = draw_mask(h.reshape(-1, h.shape[-1])).view(h.shape)
    assert not mask.all()
    ref = down.base_layer(h) + 2.0 * ((h * mask / 0.7) @ ar.t()) @ br.t()
    want = torch.autograd.grad((ref * w).sum(), (xr, ar, br))
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=atol)
    for g, r in zip(got, want):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=atol)

