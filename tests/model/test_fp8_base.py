"""The FP8 base of LoRA (`fastdpo.model.fp8`) on a tiny Llama on the CPU (the emulated FP8 products): the base's
bytes, the reference (adapters off) against the policy, the adapters' gradients through the fused LoRA path against
the same math in float32, and what a saved adapter holds."""

import gc
import json
import weakref

import pytest
import torch
from safetensors.torch import load_file

from fastdpo.errors import FastDPOError
from fastdpo.kernels import lora as lora_kernels
from fastdpo.kernels.fp8 import E4M3, Fp8LinearFunction, dequantise, quantise_rowwise
from fastdpo.model import lora
from fastdpo.model.fp8 import FP8_PROJECTIONS, check_fp8_device, convert_to_fp8_base, is_fp8_linear
from fastdpo.model.load import add_lora, load_model, save_model


def tiny(model_dirs, dtype=torch.float32):
    torch.manual_seed(0)
    return load_model(str(model_dirs("llama")), dtype, torch.device("cpu"))


def projections(model):
    return {n: m for n, m in model.named_modules() if n.split(".")[-1] in FP8_PROJECTIONS}


def ids_for(model):
    return torch.randint(4, model.config.vocab_size, (2, 11), generator=torch.Generator().manual_seed(2))


def randomise_b(model, scale=0.1):
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:  # PEFT starts B at zero
                p.copy_(scale * torch.randn(p.shape, generator=g))


def test_the_base_takes_half_the_bytes_of_bf16_and_the_bf16_weights_are_freed(model_dirs):
    model = tiny(model_dirs, torch.bfloat16)
    linears = projections(model)
    before = sum(m.weight.nbytes for m in linears.values())
    old = [weakref.ref(m.weight) for m in linears.values()]
    kept = {n: p.dtype for n, p in model.named_parameters() if "proj" not in n}  # embeddings, norms, head
    assert convert_to_fp8_base(model) == 7 * model.config.num_hidden_layers == len(linears)
    assert convert_to_fp8_base(model) == 0  # idempotent
    gc.collect()
    assert all(r() is None for r in old)  # nothing holds the bf16 weights any more
    after = sum(m.weight.nbytes + m.weight_scale.nbytes for m in linears.values())
    rows = sum(m.out_features for m in linears.values())
    assert after == before // 2 + 4 * rows  # one byte per weight, plus a float32 scale per output row
    assert all(m.weight.dtype == E4M3 and not m.weight.requires_grad and is_fp8_linear(m) for m in linears.values())
    assert {n: p.dtype for n, p in model.named_parameters() if "proj" not in n} == kept
    assert not any(k.endswith("weight_scale") for k in model.state_dict())  # the scales are never saved


def test_an_fp8_linear_computes_fp8linearfunction_on_its_weight(model_dirs):
    model = tiny(model_dirs)
    layer = model.model.layers[0].mlp.up_proj
    w = layer.weight.detach().clone()
    convert_to_fp8_base(model)
    wq, scale = quantise_rowwise(w)
    assert torch.equal(layer.weight, wq) and torch.equal(layer.weight_scale, scale)
    x = torch.randn(2, 3, layer.in_features, generator=torch.Generator().manual_seed(3))
    want = Fp8LinearFunction.apply(x.reshape(6, -1), wq, scale, None).view(2, 3, -1)
    assert torch.equal(layer(x), want)
    assert ((layer(x) - x @ w.t()).norm() / (x @ w.t()).norm()) < 0.06  # close to the bf16/float32 product


@pytest.mark.parametrize("fused", [False, True])
def test_the_reference_with_adapters_off_is_the_fp8_base_exactly(model_dirs, fused):
    """Policy and reference share the FP8 base: with fresh adapters (B = 0) the policy's logits equal the reference's
    (adapters off) bit for bit, so the log-ratio is 0 at step 0; with trained adapters, adapters off still gives the
    converted base's own logits."""
    base = tiny(model_dirs)
    convert_to_fp8_base(base)
    ids = ids_for(base)
    with torch.no_grad():
        plain = base(input_ids=ids, use_cache=False).logits
    model = add_lora(base, 4, 8, 0.0, "all-linear")
    if fused:
        assert lora.fuse_lora(model) == 7 * base.config.num_hidden_layers
    model.train()
    with torch.no_grad():
        policy = model(input_ids=ids, use_cache=False).logits
        with model.disable_adapter():
            reference = model(input_ids=ids, use_cache=False).logits
    assert torch.equal(policy, reference) and torch.equal(reference, plain)
    randomise_b(model)
    with torch.no_grad():
        trained = model(input_ids=ids, use_cache=False).logits
        with model.disable_adapter():
            reference = model(input_ids=ids, use_cache=False).logits
    assert torch.equal(reference, plain) and not torch.allclose(trained, plain, atol=1e-3)


def test_adapters_are_float32_and_wrap_the_fp8_base(model_dirs):
    base = tiny(model_dirs, torch.bfloat16)
    convert_to_fp8_base(base)
    model = add_lora(base, 4, 8, 0.0, "all-linear")
    a = model.base_model.model.model.layers[0].self_attn.q_proj
    assert is_fp8_linear(a.base_layer)
    # PEFT takes the adapters' dtype from the base's compute dtype (bf16, then float32 by its autocast), never FP8
    assert a.lora_A["default"].weight.dtype == torch.float32 and a.lora_A["default"].weight.requires_grad


def test_lora_gradients_through_the_fused_path_match_the_emulated_float32_math(model_dirs, monkeypatch):
    """One adapted projection through the fused LoRA path over the FP8 base (`LoraAddFunction` over the base's own
    `Fp8LinearFunction`): output and the gradients of x, A and B against the float32 computation of the same math."""
    base = tiny(model_dirs)
    convert_to_fp8_base(base)
    model = add_lora(base, 4, 8, 0.0, "all-linear")
    randomise_b(model)
    lora.fuse_lora(model)
    model.train()
    layer = model.base_model.model.model.layers[0].mlp.down_proj
    calls = []
    for fn in (lora_kernels.LoraAddFunction, lora_kernels.LoraLinearFunction, Fp8LinearFunction):
        monkeypatch.setattr(fn, "apply", lambda *a, _fn=fn, _apply=fn.apply: calls.append(_fn.__name__) or _apply(*a))
    g = torch.Generator().manual_seed(4)
    x = torch.randn(5, layer.in_features, generator=g, requires_grad=True)
    out = layer(x)
    assert calls == ["Fp8LinearFunction", "LoraAddFunction"]
    up = torch.randn(out.shape, generator=g)
    a_w, b_w = layer.lora_A["default"].weight, layer.lora_B["default"].weight
    gx, ga, gb = torch.autograd.grad(out, (x, a_w, b_w), up)

    wq, ws = layer.base_layer.weight, layer.base_layer.weight_scale
    xr = x.detach()
    xq, xs = quantise_rowwise(xr)
    s = layer.scaling["default"]
    a, b = (p.detach().clone().requires_grad_() for p in (a_w, b_w))
    want = dequantise(xq, xs) @ dequantise(wq, ws).t() + s * (xr @ a.t()) @ b.t()
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)
    ra, rb = torch.autograd.grad(want, (a, b), up)
    gq, gs = quantise_rowwise(up * ws.t())
    rx = dequantise(gq, gs) @ wq.float() + s * (up @ b.detach()) @ a.detach()
    for got, ref in ((gx, rx), (ga, ra), (gb, rb)):
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
    assert ga.abs().sum() > 0 and gb.abs().sum() > 0


def test_a_step_trains_the_adapters_only_and_the_saved_adapter_holds_no_fp8(model_dirs, tmp_path):
    base = tiny(model_dirs)
    convert_to_fp8_base(base)
    model = add_lora(base, 4, 8, 0.0, "all-linear")
    lora.fuse_lora(model)
    model.train()
    logits = model(input_ids=ids_for(model), use_cache=False).logits
    (logits * torch.linspace(-1, 1, logits.shape[-1])).sum().backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert grads and all("lora_" in n for n in grads)
    assert all(grads[n].abs().sum() > 0 for n in grads if "lora_B" in n)  # B gets gradients while it is zero
    save_model(model, None, tmp_path)
    saved = load_file(tmp_path / "adapter_model.safetensors")
    assert saved and all("lora_" in k and v.dtype == torch.float32 for k, v in saved.items())
    assert json.loads((tmp_path / "adapter_config.json").read_text())["base_model_name_or_path"]


def test_the_fp8_base_is_refused_on_the_cpu():
    with pytest.raises(FastDPOError, match="--fp8_base needs a CUDA GPU with FP8 tensor cores .* this run trains on cpu"):
        check_fp8_device(torch.device("cpu"))
