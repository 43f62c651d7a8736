"""The lean LoRA forward (`fastdpo.model.lora`, its Functions in `fastdpo.kernels.lora`) against PEFT's own, and
against the plain float32 computation; on torch's path here, on the kernels in tests/model/test_fused_kernels.py."""

import copy

import pytest
import torch
from lora_helpers import (
    check_dropout_under_mask,
    check_mlp_dropout_under_mask,
    ids_for,
    logits_and_grads,
    mlp_lora_model,
    peft_model,
)
from peft import LoraConfig

from fastdpo.kernels import lora as lora_kernels
from fastdpo.model import lora


def count_calls(monkeypatch, *functions) -> list:
    """Patch each autograd function's `apply` to note its name in the returned list."""
    calls = []
    for fn in functions:
        monkeypatch.setattr(fn, "apply", lambda *a, _fn=fn, _apply=fn.apply: calls.append(_fn.__name__) or _apply(*a))
    return calls


@pytest.mark.parametrize("shape,alpha,base", [("qwen3", 8, "plain"), ("qwen2", 6, "plain"), ("qwen3", 6, "other")])
def test_the_lean_forward_gives_peft_s_outputs_and_gradients(model_dirs, monkeypatch, shape, alpha, base):
    """Every adapter's output and gradients as PEFT's: over a plain frozen linear (its GEMMs in the lean function;
    Qwen2's q/k/v carry a bias; alpha 6 over rank 4 is a scale that is not a power of two), or over another base
    (here a subclass of nn.Linear, as a quantized one is not plain), whose own forward and backward run."""
    model = peft_model(model_dirs, lora_alpha=alpha, shape=shape)
    if base == "other":
        class Other(torch.nn.Linear):
            pass

        for m in model.modules():
            if hasattr(m, "base_layer") and type(m.base_layer) is torch.nn.Linear:
                m.base_layer.__class__ = Other
    ids = ids_for(model)
    want, g_want = logits_and_grads(model, ids)
    calls = count_calls(monkeypatch, lora_kernels.LoraAddFunction, lora_kernels.LoraLinearFunction)
    n = lora.fuse_lora(model)
    assert n == 7 * model.config.num_hidden_layers and lora.fuse_lora(model) == n  # idempotent
    got, g_got = logits_and_grads(model, ids)
    assert calls == [("LoraAddFunction" if base == "other" else "LoraLinearFunction")] * n
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert g_got.keys() == g_want.keys() and any("lora_A" in k for k in g_got)
    for k in g_want:  # float32 sums in another order: within a few units of the last place of the tensor's scale
        torch.testing.assert_close(g_got[k], g_want[k], rtol=1e-4, atol=1e-6 * max(1.0, g_want[k].abs().max()), msg=k)


def backward_adds(model, ids) -> int:
    """The add operators the backward of one forward runs (autograd summing a tensor's gradients among them)."""
    logits = model(input_ids=ids, use_cache=False).logits.float()
    loss = (logits * torch.linspace(-1, 1, logits.shape[-1])).sum()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        loss.backward()
    return sum(e.name in ("aten::add", "aten::add_") for e in prof.events())


def test_the_lean_forward_hands_back_one_input_gradient_per_projection(model_dirs):
    """Over a plain frozen base, the base's share of x's gradient is added by its GEMM into the adapter's, so
    autograd has one gradient per projection to sum, not two: at least one add fewer for each of a layer's MLP
    projections and attention output (whose inputs need a gradient in every layer)."""
    model = peft_model(model_dirs)
    ids = ids_for(model)
    plain = backward_adds(model, ids)
    lora.fuse_lora(model)
    model.zero_grad()
    assert plain - backward_adds(model, ids) >= 4 * model.config.num_hidden_layers


def test_in_bfloat16_the_lean_forward_is_as_close_to_float32_as_peft_s(model_dirs):
    exact = peft_model(model_dirs)
    ids = ids_for(exact)
    want, g_want = logits_and_grads(exact, ids)
    results = {}
    for fused in (False, True):
        model = peft_model(model_dirs, torch.bfloat16)
        assert model.base_model.model.model.layers[0].self_attn.q_proj.lora_A["default"].weight.dtype == torch.float32
        if fused:
            lora.fuse_lora(model)
        results[fused] = logits_and_grads(model, ids)

    def err(a, b):
        return ((a - b).norm() / b.norm()).item()

    peft_out, fused_out = err(results[False][0], want), err(results[True][0], want)
    assert fused_out < 1.5 * peft_out + 1e-3, (fused_out, peft_out)
    for k in g_want:
        assert err(results[True][1][k], g_want[k]) < 3 * err(results[False][1][k], g_want[k]) + 2e-2, k


def test_dropout_is_drawn_once_and_applied_to_the_adapter_s_input_only(model_dirs):
    """With p > 0: the mask from the generator's next draw, on the adapter's input; the base sees x as it is."""
    layer, x, a, b = check_dropout_under_mask(
        model_dirs, lambda x: torch.empty_like(x, dtype=torch.bool).bernoulli_(0.7))
    layer.eval()  # no dropout when evaluating: the plain product
    torch.testing.assert_close(layer(x), layer.base_layer(x) + 2.0 * (x @ a.t()) @ b.t(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("case", ["disabled", "merged", "dora", "two_adapters", "lora_bias"])
def test_what_the_lean_forward_does_not_serve_runs_peft_s(model_dirs, monkeypatch, case):
    model = peft_model(model_dirs, use_dora=case == "dora", lora_bias=case == "lora_bias")
    if case == "lora_bias":
        with torch.no_grad():
            for n, p in model.named_parameters():
                if "lora_B" in n and n.endswith("bias"):
                    p.fill_(0.3)
    if case == "two_adapters":
        model.add_adapter("other", LoraConfig(r=2, target_modules="all-linear"))
        model.base_model.set_adapter(["default", "other"])
    ids = ids_for(model)
    plain = copy.deepcopy(model)
    lora.fuse_lora(model)
    calls = count_calls(monkeypatch, lora_kernels.LoraAddFunction, lora_kernels.LoraLinearFunction)
    with torch.no_grad():
        if case == "disabled":
            with model.disable_adapter(), plain.disable_adapter():
                got, want = model(input_ids=ids).logits, plain(input_ids=ids).logits
        else:
            if case == "merged":
                model.merge_adapter()
                plain.merge_adapter()
            got, want = model(input_ids=ids).logits, plain(input_ids=ids).logits
    assert calls == []
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_a_deep_copy_keeps_the_lean_forward_on_its_own_modules(model_dirs):
    model = peft_model(model_dirs)
    lora.fuse_lora(model)
    twin = copy.deepcopy(model)
    layer = twin.base_model.model.model.layers[0].self_attn.q_proj
    assert layer.forward.__self__ is layer
    ids = ids_for(model)
    with torch.no_grad():
        torch.testing.assert_close(twin(input_ids=ids).logits, model(input_ids=ids).logits)


@pytest.mark.parametrize("kernels", ["auto", "torch"])
def test_training_s_lora_layers_take_the_lean_forward_unless_kernels_torch(tmp_path, model_dirs, kernels):
    from data_helpers import easy_rows, write_jsonl

    from fastdpo import TrainConfig, Trainer

    data = write_jsonl(tmp_path / "data.jsonl", easy_rows(8, seed=2))
    cfg = TrainConfig(model=str(model_dirs("qwen3")), dataset=[str(data)], output_dir=str(tmp_path / kernels),
                      train_type="lora", lora_rank=4, max_steps=1, per_device_train_batch_size=4, kernels=kernels)
    trainer = Trainer(cfg)
    layers = [m for m in trainer.s.model.modules() if hasattr(m, "lora_A")]
    lean = [m.forward.__func__ is lora._lora_forward for m in layers if hasattr(m.forward, "__func__")]
    assert layers and lean.count(True) == (len(layers) if kernels == "auto" else 0)
    assert trainer.step().finite


@pytest.mark.parametrize("value", ["1", "1.5", "-0.1", "nan"])
def test_a_dropout_probability_outside_0_to_1_is_refused_with_its_range(value):
    from fastdpo.cli import build_parser
    from fastdpo.config import TrainConfig, build_config
    from fastdpo.errors import FastDPOError

    def parse(*flags):
        return build_config(build_parser().parse_args(["train", "--model", "m", "--dataset", "d", *flags]), TrainConfig)

    with pytest.raises(FastDPOError, match=r"--lora_dropout is a drop probability in \[0, 1\)"):
        parse("--train_type", "lora", "--lora_dropout", value).validate_training()
    parse("--train_type", "lora", "--lora_dropout", "0").validate_training()
    parse("--train_type", "lora", "--lora_dropout", "0.99").validate_training()


def saved_bytes(model, ids) -> int:
    """Bytes autograd keeps for the backward of one forward (each storage once, the weights not counted)."""
    from model_helpers import saved_bytes as kept

    return kept(model, lambda: model(input_ids=ids, use_cache=False).logits.sum())


def test_a_lean_mlp_s_lora_down_projection_keeps_no_product_and_gives_peft_s_gradients(model_dirs, monkeypatch):
    """The SwiGLU product feeds a LoRA down projection without being kept: outputs and gradients equal PEFT's on
    the plain MLP, and a product's bytes per token and layer less is kept."""
    plain = mlp_lora_model(model_dirs, fused=False)
    model = mlp_lora_model(model_dirs)
    model.load_state_dict(plain.state_dict())
    ids = ids_for(model)
    calls = []
    apply = lora_kernels.SiluMulLoraDownFunction.apply
    monkeypatch.setattr(lora_kernels.SiluMulLoraDownFunction, "apply", lambda *a: calls.append(a[-1]) or apply(*a))
    want, g_want = logits_and_grads(plain, ids)
    got, g_got = logits_and_grads(model, ids)
    assert calls == [False] * model.config.num_hidden_layers  # every layer, none skipped outside a recompute
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert g_got.keys() == g_want.keys() and any("down_proj.lora_A" in k for k in g_got)
    for k in g_want:  # the lean norms' analytic backward rounds apart from autograd's: float32's rounding, no more
        assert (g_got[k] - g_want[k]).norm() <= 1e-5 * g_want[k].norm(), k
    product = ids.numel() * model.config.intermediate_size * 4 * model.config.num_hidden_layers
    assert saved_bytes(plain, ids) - saved_bytes(model, ids) >= product


def test_the_lora_down_s_dropout_is_drawn_once_on_the_product_and_applied_again_in_the_backward(model_dirs):
    """On torch's path the mask is `bernoulli_` on the product's shape, the generator's next draw."""
    check_mlp_dropout_under_mask(model_dirs, lambda h: torch.empty_like(h, dtype=torch.bool).bernoulli_(0.7))


@pytest.mark.parametrize("reentrant", [False, True])
@pytest.mark.parametrize("dropout", [0.0, 0.3])
def test_a_recompute_skips_the_lora_down_s_base_gemm_and_gives_the_gradients_of_none(model_dirs, monkeypatch,
                                                                                      reentrant, dropout):
    """Under full checkpointing the recompute leaves the down projection's output unwritten (nothing keeps it), and
    the gradients equal those without checkpointing, bit for bit, dropout's masks replayed."""
    from fastdpo.model.memory import apply_checkpointing

    skips = []
    apply = lora_kernels.SiluMulLoraDownFunction.apply
    monkeypatch.setattr(lora_kernels.SiluMulLoraDownFunction, "apply", lambda *a: skips.append(a[-1]) or apply(*a))

    weights = mlp_lora_model(model_dirs, dropout=dropout).state_dict()

    def trained(policy):
        m = mlp_lora_model(model_dirs, dropout=dropout)
        m.load_state_dict(weights)
        if policy != "none":
            apply_checkpointing(m, policy, reentrant=reentrant)
        m.train()
        torch.manual_seed(5)
        return logits_and_grads(m, ids_for(m))

    want_out, want = trained("none")
    layers = len(skips)
    assert skips == [False] * layers and layers > 0
    skips.clear()
    got_out, got = trained("full")
    # each layer's recompute skips; a first forward never does (the reentrant form runs it without grad, which
    # keeps nothing and takes the plain path)
    assert skips.count(True) == layers and skips.count(False) <= layers
    assert torch.equal(got_out, want_out)
    assert want.keys() == got.keys() and all(torch.equal(got[n], want[n]) for n in want)
