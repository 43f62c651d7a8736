"""FP8 training of a full fine-tune (--fp8, `fastdpo.model.fp8.convert_to_fp8_training`) on the CPU, where the FP8
products are emulated (the same e4m3 values and scales, float32 math): the linear's output and gradients against the
same quantised math written out in float32, both recipes; which layers convert; siblings sharing one quantised
input; the frozen reference copy against the policy at step 0; and the flags' checks."""

import copy

import pytest
import torch

from fastdpo.config import TrainConfig
from fastdpo.errors import FastDPOError
from fastdpo.kernels import fp8 as fp8_kernels
from fastdpo.kernels.fp8 import E4M3_MAX, Fp8TrainLinearFunction, quantise, quantise_tensorwise
from fastdpo.model.fp8 import FP8_PROJECTIONS, convert_to_fp8_training, is_fp8_trained
from fastdpo.model.load import load_model


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def q_rows(t):
    s = t.abs().amax(1, keepdim=True).clamp(min=1e-12) / E4M3_MAX
    return (t / s).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).float() * s


def q_tensor(t):
    s = t.abs().amax().clamp(min=1e-12) / E4M3_MAX
    return (t / s).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).float() * s


def written_out(x, w, g, recipe):
    """The FP8 linear's three products in float32 from the quantised operands: y = Q(x) Q(w)^T; x's gradient
    Q(g * s_w^T) Wq (row-wise; s_w the weight's row scales, Wq its e4m3 values) or Q(g) Q(w) (tensor-wise); the
    weight's gradient g^T x unquantised."""
    if recipe == "rowwise":
        y = q_rows(x) @ q_rows(w).t()
        s_w = w.abs().amax(1, keepdim=True).clamp(min=1e-12) / E4M3_MAX
        gx = q_rows(g * s_w.t()) @ (q_rows(w) / s_w)
    else:
        y = q_tensor(x) @ q_tensor(w).t()
        gx = q_tensor(g) @ q_tensor(w)
    return y, gx, g.t() @ x


@pytest.mark.parametrize("recipe", ["rowwise", "tensorwise"])
@pytest.mark.parametrize("m,k,n", [(7, 24, 40), (33, 64, 48)])
def test_the_fp8_trained_linear_equals_the_quantised_math_and_its_weight_gradient_is_exact(recipe, m, k, n):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(m, k, generator=g).requires_grad_()
    w = (torch.randn(n, k, generator=g) / k**0.5).requires_grad_()
    b = torch.randn(n, generator=g).requires_grad_()
    up = torch.randn(m, n, generator=g)
    wq, w_scale = quantise(w.detach(), recipe)
    y = Fp8TrainLinearFunction.apply(x, w, b, wq, w_scale, recipe)
    gx, gw, gb = torch.autograd.grad(y, (x, w, b), up)
    want_y, want_gx, want_gw = written_out(x.detach(), w.detach(), up, recipe)
    torch.testing.assert_close(y, want_y + b.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gx, want_gx, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gw, want_gw, rtol=1e-6, atol=1e-6)  # the weight's gradient is not quantised
    torch.testing.assert_close(gb, up.sum(0))
    # the quantisation is really there: the output and x's gradient are not the plain products
    assert 1e-4 < rel(y - b.detach(), x.detach() @ w.detach().t()) < 0.08
    assert 1e-4 < rel(gx, up @ w.detach()) < 0.08


def test_tensorwise_scales_the_whole_tensor_by_its_absolute_maximum():
    x = torch.randn(6, 32, generator=torch.Generator().manual_seed(4)) * 3
    q, s = quantise_tensorwise(x)
    assert s.shape == (1, 1) and s.item() == pytest.approx(x.abs().max().item() / E4M3_MAX)
    assert q.float().abs().max().item() == E4M3_MAX  # only the largest element reaches 448
    assert torch.equal(q.float() * s, q_tensor(x))


def tiny(model_dirs, dtype=torch.float32):
    torch.manual_seed(0)
    return load_model(str(model_dirs("llama")), dtype, torch.device("cpu"))


def logps(model, ids):
    out = model(input_ids=ids).logits.float().log_softmax(-1)
    return out[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1)


@pytest.mark.parametrize("recipe", ["rowwise", "tensorwise"])
def test_every_decoder_projection_converts_and_nothing_else(model_dirs, recipe):
    model = tiny(model_dirs)
    n = convert_to_fp8_training(model, recipe)
    converted = {name.split(".")[-1] for name, m in model.named_modules() if is_fp8_trained(m)}
    assert n == 7 * model.config.num_hidden_layers and converted == FP8_PROJECTIONS
    assert not is_fp8_trained(model.lm_head) and convert_to_fp8_training(model, recipe) == 0  # idempotent
    assert all(p.dtype == torch.float32 and p.requires_grad for p in model.parameters())  # weights stay as they were


def test_the_converted_model_is_close_to_the_plain_one_not_equal_and_trains(model_dirs):
    plain, model = tiny(model_dirs), tiny(model_dirs)
    convert_to_fp8_training(model)
    ids = torch.randint(4, model.config.vocab_size, (2, 11), generator=torch.Generator().manual_seed(2))
    want, got = logps(plain, ids).detach(), logps(model, ids)
    assert 0 < (got - want).abs().max().item() < 0.05  # FP8 rounding of a tiny model's log-probs, no more
    got.sum().backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    assert all(g is not None and torch.isfinite(g).all() for g in grads.values())
    logps(plain, ids).sum().backward()
    for n, p in plain.named_parameters():  # every gradient near the unquantised one
        assert rel(grads[n], p.grad) < 0.1, n


def test_q_k_v_quantise_their_shared_input_once(model_dirs, monkeypatch):
    model = tiny(model_dirs)
    convert_to_fp8_training(model)
    seen = []
    real = fp8_kernels.quantise_rowwise

    def counting(x, *a, **kw):
        seen.append(tuple(x.shape))
        return real(x, *a, **kw)

    monkeypatch.setattr(fp8_kernels, "quantise_rowwise", counting)
    with torch.no_grad():
        model(input_ids=torch.tensor([[5, 6, 7, 8, 9]]))
    layers, c = model.config.num_hidden_layers, model.config
    inputs = sum(1 for s in seen if s[0] == 5)  # activations (5 tokens): one per distinct input, not per projection
    assert inputs == 4 * layers  # the normed input (q, k, v), attention's output (o), the normed input (gate,
    # up), the MLP's product (down)
    assert len(seen) - inputs == 7 * layers  # every weight quantised at each forward: it trains
    assert (c.intermediate_size, c.hidden_size) in seen


def test_the_frozen_reference_copy_equals_the_policy_at_step_zero_and_quantises_its_weights_once(model_dirs,
                                                                                                monkeypatch):
    policy = tiny(model_dirs)
    convert_to_fp8_training(policy, "tensorwise")
    ref = copy.deepcopy(policy).requires_grad_(False)
    ids = torch.randint(4, policy.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        assert torch.equal(logps(ref, ids), logps(policy, ids))  # the same FP8 products on both sides
    calls = []
    real = fp8_kernels.quantise_tensorwise
    monkeypatch.setattr(fp8_kernels, "quantise_tensorwise", lambda x, *a: calls.append(x.shape) or real(x, *a))
    with torch.no_grad():
        logps(ref, ids)
    assert len(calls) == 4 * policy.config.num_hidden_layers  # activations only: the frozen weights are kept
    # new weights loaded into the reference are quantised again, not served from the old ones
    with torch.no_grad():
        before = logps(ref, ids)
        for p in ref.parameters():
            p.mul_(1.5)
        assert not torch.equal(logps(ref, ids), before)


def test_the_flags_are_checked():
    with pytest.raises(FastDPOError, match="--fp8_base"):
        TrainConfig(model="m", dataset="d", fp8=True, train_type="lora").validate()
    with pytest.raises(FastDPOError, match="--fp8 "):
        TrainConfig(model="m", dataset="d", fp8=True, device="cpu").validate_training()
    with pytest.raises(FastDPOError, match="fp8_recipe"):
        TrainConfig(model="m", dataset="d", fp8=True, fp8_recipe="blockwise").validate()
    with pytest.raises(FastDPOError, match="--fp8 with --torch_compile"):
        TrainConfig(model="m", dataset="d", fp8=True, torch_compile=True).validate()
    with pytest.raises(FastDPOError, match="--fp8;"):
        TrainConfig(model="m", dataset="d", fp8_base=True, train_type="full").validate()


@pytest.mark.parametrize("policy,reentrant", [("full", False), ("full", True), ("ffn", False)])
def test_checkpointing_recomputes_the_fp8_products_as_the_forward_ran_them(model_dirs, policy, reentrant):
    """Activation checkpointing over FP8 layers: the recompute quantises its inputs again (the inputs quantised in the
    forward were not kept), and every gradient equals the run without checkpointing."""
    from fastdpo.model.memory import apply_checkpointing

    ids = torch.randint(4, 60, (2, 13), generator=torch.Generator().manual_seed(9))
    grads = []
    for ckpt in (False, True):
        model = tiny(model_dirs)
        model.config.use_cache = False
        convert_to_fp8_training(model)
        if ckpt:
            assert apply_checkpointing(model, policy, reentrant)
        logps(model, ids).sum().backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    for n, g in grads[0].items():
        torch.testing.assert_close(grads[1][n], g, rtol=0, atol=0, msg=n)


def test_a_kept_quantisation_is_dropped_once_its_readers_have_read_it():
    from fastdpo.kernels.fp8 import keep_quantised, kept_quantised

    x = torch.randn(4, 16)
    q, s = quantise(x, "rowwise")
    keep_quantised(x, "rowwise", q, s, 2)
    assert kept_quantised(x, "tensorwise") is None  # another recipe's quantisation is not this one
    assert kept_quantised(x, "rowwise")[0] is q and kept_quantised(x, "rowwise")[1] is s
    assert kept_quantised(x, "rowwise") is None and "_fastdpo_fp8_input" not in x.__dict__  # two reads, then gone
    keep_quantised(x, "rowwise", q, s, 1)
    x.mul_(2)  # changed since: not served
    assert kept_quantised(x, "rowwise") is None


def test_no_quantised_copy_outlives_the_forward_on_the_activations_autograd_keeps(model_dirs):
    """The normed inputs are kept for the weights' gradients: their e4m3 copies are read by q, k, v (gate, up) and then
    dropped, not kept with them until the backward."""
    model = tiny(model_dirs)
    convert_to_fp8_training(model)
    seen = []
    for layer in model.model.layers:
        for proj in (layer.self_attn.q_proj, layer.mlp.gate_proj):
            proj.register_forward_hook(lambda m, args, out: seen.append(args[0]))
    logps(model, torch.tensor([[5, 6, 7, 8, 9]]))
    assert len(seen) == 2 * model.config.num_hidden_layers
    assert not any("_fastdpo_fp8_input" in x.__dict__ for x in seen)
