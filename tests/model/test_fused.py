"""Lean RMSNorm and SwiGLU (`fastdpo.model.fused`): the forward bit-identical to the modules' own, the backward equal
to autograd's through the original operations, fewer bytes kept for the backward, and modules whose forward differs
left alone. The fused layers on the Triton kernels: tests/model/test_fused_kernels.py."""

import logging

import pytest
import torch
from model_helpers import loss_and_grads, small_model
from transformers import AutoModelForCausalLM

from fastdpo.model import fused
from fastdpo.model.fused import fuse_layers, unfused


@pytest.mark.parametrize("family", ["qwen3", "llama"])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
def test_forward_is_bit_identical_and_gradients_match(family, dtype, tol):
    ids = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(1))
    plain = small_model(family, dtype)
    want_out, want = loss_and_grads(plain, ids)
    lean = small_model(family, dtype)
    assert set(fuse_layers(lean)) >= {f"{'Qwen3' if family == 'qwen3' else 'Llama'}{k}" for k in ("RMSNorm", "MLP")}
    got_out, got = loss_and_grads(lean, ids)
    assert torch.equal(got_out, want_out)  # the same forward, bit for bit
    for name in want:
        a, b = got[name], want[name]
        assert ((a - b).norm() / b.norm().clamp(min=1e-12)).item() < tol, name


@pytest.mark.parametrize("reentrant", [False, True])
@pytest.mark.parametrize("policy", ["full", "ffn", "keep:1"])
def test_the_recompute_skips_the_down_projection_and_the_gradients_stay_the_same(policy, reentrant, monkeypatch):
    import torch.nn.functional as F

    from fastdpo.model.memory import apply_checkpointing

    ids = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(2))
    lean = small_model("qwen3")
    fuse_layers(lean)
    want_out, want = loss_and_grads(lean, ids)
    m = small_model("qwen3")
    fuse_layers(m)
    apply_checkpointing(m, policy, reentrant=reentrant)
    downs = {id(layer.mlp.down_proj.weight) for layer in m.model.layers}
    calls, linear = [], F.linear

    def counted(x, weight, *args, **kwargs):
        if id(weight) in downs:
            calls.append(torch.is_grad_enabled())
        return linear(x, weight, *args, **kwargs)

    monkeypatch.setattr(F, "linear", counted)
    got_out, got = loss_and_grads(m, ids)
    assert len(calls) == len(downs)  # the forward's, one per layer: none again in the backward's recompute
    assert torch.equal(got_out, want_out)
    assert want.keys() == got.keys() and all(torch.equal(got[n], want[n]) for n in want)


def test_fewer_bytes_are_kept_for_the_backward():
    from model_helpers import saved_bytes

    def kept(m):
        return saved_bytes(m, lambda: m.model(input_ids=torch.zeros(1, 256, dtype=torch.long)))

    plain, lean = small_model("qwen3", torch.bfloat16), small_model("qwen3", torch.bfloat16)
    fuse_layers(lean)
    assert kept(lean) < 0.7 * kept(plain)


def test_a_module_whose_forward_differs_keeps_it_and_eval_uses_the_plain_path():
    class OddRMSNorm(torch.nn.Module):  # Gemma's form: (1 + weight), applied in float32
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.randn(8) * 0.1)
            self.variance_epsilon = 1e-6

        def forward(self, x):
            xf = x.float()
            y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
            return (y * (1.0 + self.weight.float())).to(x.dtype)

    odd = torch.nn.Sequential(OddRMSNorm())
    assert fuse_layers(odd) == [] and "forward" not in odd[0].__dict__
    lean = small_model("llama", torch.float32)
    fuse_layers(lean)
    assert fuse_layers(lean) == []  # idempotent: nothing left to replace
    norm = lean.model.norm
    with torch.no_grad():
        x = torch.randn(2, 64)
        assert torch.equal(norm(x), norm._fastdpo_plain_forward(x))


def test_a_module_left_on_torch_s_path_is_named_once_in_a_warning(caplog):
    class ShiftedEpsRMSNorm(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.randn(8) * 0.1)
            self.variance_epsilon = 1e-6

        def forward(self, x):
            xf = x.float()
            return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 2e-6) * self.weight).to(x.dtype)

    with caplog.at_level(logging.WARNING, logger="fastdpo"):
        fuse_layers(torch.nn.Sequential(ShiftedEpsRMSNorm(), ShiftedEpsRMSNorm()))
        fuse_layers(torch.nn.Sequential(ShiftedEpsRMSNorm()))
    said = [r.getMessage() for r in caplog.records if "ShiftedEpsRMSNorm" in r.getMessage()]
    assert len(said) == 1 and "torch's path" in said[0]


def test_the_lean_forwards_survive_a_model_loaded_with_transformers_defaults_and_train_eval_switches(tmp_path):
    """transformers 5 kernelizes a model loaded with its defaults when the `kernels` package is installed, and
    rebinds each RMSNorm's forward on every .train(); fusing turns that off, and a forward rebound anyway is bound
    again by the next fuse_layers and named by `unfused`."""
    from peft import LoraConfig, get_peft_model

    small_model("qwen3").save_pretrained(tmp_path)
    lm = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert "Qwen3RMSNorm" in fuse_layers(lm)
    lm.train()
    lm.eval()
    wrapped = get_peft_model(lm, LoraConfig(r=4, target_modules="all-linear")).train()
    norm = lm.model.layers[0].input_layernorm
    assert "forward" in norm.__dict__ and unfused(wrapped) == []
    del norm.forward  # what a rebinding leaves
    assert unfused(wrapped) == ["Qwen3RMSNorm"]
    fuse_layers(wrapped)
    assert unfused(wrapped) == [] and norm.forward.__func__ is fused._norm_forward


def test_checkpointing_wraps_the_lean_forward_and_gives_it_back():
    from fastdpo.model.memory import apply_checkpointing

    lean = small_model("qwen3", torch.float32)
    fuse_layers(lean)
    mlp = lean.model.layers[0].mlp
    lean_forward = mlp.forward
    apply_checkpointing(lean, "ffn")
    assert mlp.forward is not lean_forward
    apply_checkpointing(lean, "none")
    assert mlp.forward is lean_forward


def test_the_lean_layers_compile_and_give_the_eager_gradients():
    """--torch_compile compiles each decoder layer with the lean forwards inside: the same loss and gradients as
    eager (within float32 rounding), with the lean functions traced, not falling back."""
    import torch._dynamo

    from fastdpo.model.memory import compile_layers

    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(2))
    eager = small_model("qwen3", torch.float32)
    fuse_layers(eager)
    want_out, want = loss_and_grads(eager, ids)
    torch._dynamo.reset()
    compiled = small_model("qwen3", torch.float32)
    fuse_layers(compiled)
    compile_layers(compiled, backend="aot_eager")
    got_out, got = loss_and_grads(compiled, ids)
    assert torch.allclose(got_out, want_out, atol=1e-5)
    for name in want:
        assert torch.allclose(got[name], want[name], atol=1e-5, rtol=1e-4), name


def test_kernels_that_cannot_be_built_leave_the_model_its_own_layers(monkeypatch, caplog):
    """On a GPU where the Triton kernels do not build, --kernels auto trains on the model's own layers with a warning,
    and --kernels triton refuses with the reason."""
    import logging

    from fastdpo.config import TrainConfig
    from fastdpo.errors import FastDPOError
    from fastdpo.training import setup

    monkeypatch.setattr(setup, "kernels_wanted", lambda choice, device, compiling: True)
    monkeypatch.setattr(setup, "kernels_ready",
                        lambda widths, dtype, device, head_dim, lora, rank, fp8, fp8_base: "RuntimeError: no sm_61 support")
    m = small_model("qwen3")
    cfg = TrainConfig(model="m", dataset=["d"])
    with caplog.at_level(logging.WARNING, logger="fastdpo"):
        setup.fuse_kernels(cfg, m, torch.device("cpu"))
    assert "cannot be built on this GPU (RuntimeError: no sm_61 support)" in caplog.text
    assert not any("_fastdpo_plain_forward" in mod.__dict__ for mod in m.modules())
    cfg.kernels = "triton"
    with pytest.raises(FastDPOError, match="--kernels triton: the Triton kernels cannot be built"):
        setup.fuse_kernels(cfg, small_model("qwen3"), torch.device("cpu"))
    widths = []
    monkeypatch.setattr(setup, "kernels_ready",
                        lambda w, dtype, device, head_dim, lora, rank, fp8, fp8_base: widths.append(
                            (w, dtype, head_dim, lora, rank, fp8, fp8_base)))
    cfg.kernels = "auto"
    fused = small_model("qwen3")
    setup.fuse_kernels(cfg, fused, torch.device("cpu"))
    assert widths == [([64, 16], torch.float32, 16, False, 0, False, False)]  # the hidden size and Qwen3's head size
    assert fused.model.norm._fastdpo_kernels and fused.model.layers[0].self_attn._fastdpo_kernels


@pytest.mark.parametrize("train_type,dropout,adapters,rank", [("lora", 0.05, "", 16), ("lora", 0.0, "", 0),
                                                              ("qlora", 0.05, "", 0), ("full", 0.05, "", 0),
                                                              ("lora", 0.05, "adapter_dir", 0)])
def test_lora_s_dropout_kernels_are_built_ahead_for_the_rank_that_trains(monkeypatch, tmp_path, train_type, dropout,
                                                                         adapters, rank):
    """The build started while data loads and the wait before fusing name the same LoRA dropout rank (one build,
    not two): the configured rank where the lean LoRA linear applies dropout, else none."""
    import json

    from fastdpo.config import TrainConfig
    from fastdpo.training import setup

    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 64, "num_attention_heads": 4}))
    cfg = TrainConfig(model=str(tmp_path), dataset=["d"], train_type=train_type, lora_rank=16, lora_dropout=dropout,
                      adapters=adapters)
    started, waited = [], []
    monkeypatch.setattr(setup, "build_ahead", lambda *a: started.append(a[5]))  # (widths, ..., rank, fp8)
    monkeypatch.setattr(setup, "kernels_ready", lambda *a: waited.append(a[5]))
    monkeypatch.setattr(setup, "kernels_wanted", lambda choice, device, compiling: True)
    setup.build_kernels_ahead(cfg.model, torch.float32, torch.device("cpu"), False, cfg.uses_lora,
                              setup.dropout_rank(cfg))
    setup.fuse_kernels(cfg, small_model("qwen3"), torch.device("cpu"))
    assert started == waited == [rank]


@pytest.mark.parametrize("fp8, recipe, fused", [(False, "rowwise", False), (True, "rowwise", True),
                                                 (True, "tensorwise", False)])
def test_fp8_runs_wait_for_the_e4m3_writing_builds_their_kernels_use(monkeypatch, fp8, recipe, fused):
    """--fp8 with row-wise scales: the norm and SwiGLU builds that write e4m3 copies are built ahead and waited for
    (tensor-wise scales quantise apart: none of them)."""
    from fastdpo.config import TrainConfig
    from fastdpo.training import setup

    waited = []
    monkeypatch.setattr(setup, "kernels_ready", lambda *a: waited.append(a[6]))
    monkeypatch.setattr(setup, "kernels_wanted", lambda choice, device, compiling: True)
    cfg = TrainConfig(model="m", dataset=["d"], fp8=fp8, fp8_recipe=recipe)
    setup.fuse_kernels(cfg, small_model("qwen3"), torch.device("cpu"))
    assert waited == [fused] and setup.fused_fp8(cfg) is fused


def test_an_fp8_base_run_waits_for_the_row_quantisation_s_builds(monkeypatch):
    """--fp8_base: the row-wise quantisation's kernel (the base's activations and gradients) is built ahead and
    waited for; the e4m3-writing norm and SwiGLU builds are not (the LoRA base's norms write bf16)."""
    from fastdpo.config import TrainConfig
    from fastdpo.training import setup

    waited = []
    monkeypatch.setattr(setup, "kernels_ready", lambda *a: waited.append(a[6:]))
    monkeypatch.setattr(setup, "kernels_wanted", lambda choice, device, compiling: True)
    for fp8_base in (True, False):
        cfg = TrainConfig(model="m", dataset=["d"], train_type="lora", fp8_base=fp8_base)
        setup.fuse_kernels(cfg, small_model("qwen3"), torch.device("cpu"))
    assert waited == [(False, True), (False, False)]


def test_a_non_standard_rotation_keeps_its_own_function(monkeypatch):
    """A modeling module whose `apply_rotary_pos_emb` rotates part of each head (Phi's form) is left as it is."""
    import sys
    import types

    from fastdpo.model import fused

    def partial(q, k, cos, sin, unsqueeze_dim=1):
        d = cos.shape[-1] // 2
        return (torch.cat((q[..., :d] * cos[:, None, :, :d], q[..., d:]), -1),
                torch.cat((k[..., :d] * cos[:, None, :, :d], k[..., d:]), -1))

    mod = types.ModuleType("fake_modeling")
    mod.apply_rotary_pos_emb = partial
    monkeypatch.setitem(sys.modules, "fake_modeling", mod)
    fused._rope_module.cache_clear()
    try:
        assert not fused._rope_module("fake_modeling") and mod.apply_rotary_pos_emb is partial
        import transformers.models.llama.modeling_llama as llama

        assert fused._rope_module(llama.__name__) and llama.apply_rotary_pos_emb._fastdpo_plain is not None
    finally:
        fused._rope_module.cache_clear()


def test_the_kernels_shapes_are_read_from_a_local_config_without_transformers(tmp_path):
    import json

    from fastdpo.kernels.warmup import head_size, norm_widths
    from fastdpo.training.setup import _config_fields

    real = small_model("qwen3").config
    real.save_pretrained(tmp_path)
    fields = _config_fields(str(tmp_path), False)
    assert not hasattr(fields, "to_dict")  # read as JSON, not through AutoConfig
    assert norm_widths(fields) == norm_widths(real) and head_size(fields) == head_size(real) == 16
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "x", "text_config": {"hidden_size": 48,
                                                                                         "num_attention_heads": 4}}))
    assert norm_widths(_config_fields(str(tmp_path), False)) == [48, 12]


def test_an_mlp_whose_output_a_later_op_keeps_is_recomputed_whole():
    from transformers import Olmo2Config

    from fastdpo.model.memory import apply_checkpointing

    def olmo2():  # its post-feed-forward norm keeps the MLP's output for its backward
        torch.manual_seed(0)
        cfg = Olmo2Config(vocab_size=128, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2)
        m = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").train()
        fuse_layers(m)
        return m

    ids = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(3))
    _, want = loss_and_grads(olmo2(), ids)
    m = olmo2()
    apply_checkpointing(m, "full")
    _, got = loss_and_grads(m, ids)
    for name in want:
        assert torch.allclose(got[name], want[name], rtol=1e-5, atol=1e-7), name


@pytest.mark.parametrize("family", ["qwen3", "llama"])
@pytest.mark.parametrize("policy", ["full", "ffn", "attn"])
def test_the_reentrant_recompute_gives_the_gradients_of_no_checkpointing(family, policy, monkeypatch):
    from fastdpo.model import memory
    from fastdpo.model.memory import apply_checkpointing

    ids = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(5))
    lean = small_model(family)
    fuse_layers(lean)
    want_out, want = loss_and_grads(lean, ids)
    m = small_model(family)
    fuse_layers(m)
    apply_checkpointing(m, policy, reentrant=True)
    runs, apply = [], memory._Recomputed.apply
    monkeypatch.setattr(memory._Recomputed, "apply", lambda *a: runs.append(1) or apply(*a))
    got_out, got = loss_and_grads(m, ids)
    assert len(runs) == len(m.model.layers)  # every region took the reentrant form
    assert torch.equal(got_out, want_out)
    assert want.keys() == got.keys() and all(torch.equal(got[n], want[n]) for n in want)


def test_regions_without_grads_through_their_input_keep_the_non_reentrant_form(monkeypatch):
    from peft import LoraConfig, get_peft_model

    from fastdpo.model import memory
    from fastdpo.model.memory import apply_checkpointing, draws_random

    runs, apply = [], memory._Recomputed.apply
    monkeypatch.setattr(memory._Recomputed, "apply", lambda *a: runs.append(1) or apply(*a))
    ids = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(6))
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "down_proj"], init_lora_weights=False,
                      lora_dropout=0.0)
    plain = get_peft_model(small_model("qwen3"), lora)
    _, want = loss_and_grads(plain, ids)
    m = get_peft_model(small_model("qwen3"), lora)
    apply_checkpointing(m, "full", reentrant=True)
    _, got = loss_and_grads(m, ids)
    # frozen embeddings: the first layer's input carries no grads (torch's form); the second's does (its adapters')
    assert len(runs) == 1 and any("lora_A" in n for n in want) and want.keys() == got.keys()
    for n in want:
        assert torch.allclose(got[n], want[n], rtol=1e-5, atol=1e-7), n

    dropped = small_model("qwen3")
    assert not draws_random(dropped.model.layers[0])
    dropped.config.attention_dropout = 0.1
    for layer in dropped.model.layers:
        layer.self_attn.attention_dropout = 0.1
    assert draws_random(dropped.model.layers[0])
    holder = torch.nn.Module()
    holder.attention_dropout = torch.nn.Dropout(0.0)  # some attentions keep a module under that name
    assert not draws_random(holder)
    holder.attention_dropout = torch.nn.Dropout(0.2)
    assert draws_random(holder)

def test_regions_with_dropout_recompute_in_the_reentrant_form_with_the_same_masks(monkeypatch):
    """A layer that draws random numbers takes the reentrant form too: its recompute starts from the generator's
    state of the forward, so it draws the masks the forward drew, and the gradients equal no checkpointing's from the
    same seed. The generator then goes on as it would have."""
    from fastdpo.model import memory
    from fastdpo.model.memory import apply_checkpointing

    runs, apply = [], memory._Recomputed.apply
    monkeypatch.setattr(memory._Recomputed, "apply", lambda *a: runs.append(1) or apply(*a))
    ids = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(6))

    def dropped():
        m = small_model("qwen3")
        m.config.attention_dropout = 0.3
        for layer in m.model.layers:
            layer.self_attn.attention_dropout = 0.3
            layer.mlp.act_fn = torch.nn.Sequential(layer.mlp.act_fn, torch.nn.Dropout(0.2))
        return m.train()

    def seeded(m, seed):
        torch.manual_seed(seed)
        out = loss_and_grads(m, ids)
        return out, torch.rand(3)

    (want_out, want), want_next = seeded(dropped(), 11)
    (other_out, _), _ = seeded(dropped(), 12)
    assert not torch.equal(other_out, want_out)  # the masks differ from seed to seed: dropout acts
    m = dropped()
    apply_checkpointing(m, "full", reentrant=True)
    (got_out, got), got_next = seeded(m, 11)
    assert len(runs) == len(m.model.layers)
    assert torch.equal(got_out, want_out) and torch.equal(got_next, want_next)
    assert want.keys() == got.keys() and all(torch.equal(got[n], want[n]) for n in want)


def test_a_forward_with_a_cache_keeps_the_non_reentrant_form(monkeypatch):
    from fastdpo.model import memory
    from fastdpo.model.memory import apply_checkpointing

    runs, apply = [], memory._Recomputed.apply
    monkeypatch.setattr(memory._Recomputed, "apply", lambda *a: runs.append(1) or apply(*a))
    ids = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(7))

    def grads(m):
        m.zero_grad()
        m(input_ids=ids, use_cache=True).logits.float().log_softmax(-1)[..., 3].mean().backward()
        return {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}

    lean = small_model("qwen3")
    fuse_layers(lean)
    want = grads(lean)
    m = small_model("qwen3")
    fuse_layers(m)
    apply_checkpointing(m, "full", reentrant=True)
    got = grads(m)  # a recompute would append the layer's keys to the cache a second time
    assert not runs and all(torch.allclose(got[n], want[n], rtol=1e-5, atol=1e-7) for n in want)


def test_the_reentrant_recompute_refuses_autograd_grad():
    from fastdpo.model.memory import apply_checkpointing

    m = small_model("qwen3")
    fuse_layers(m)
    apply_checkpointing(m, "full", reentrant=True)
    loss = m(input_ids=torch.randint(0, 128, (1, 8)), use_cache=False).logits.float().mean()
    with pytest.raises(RuntimeError, match="loss.backward"):  # the layers' own grads would go to .grad instead
        torch.autograd.grad(loss, [m.model.embed_tokens.weight])


def test_each_layer_s_hidden_states_are_released_once_its_recompute_has_run():
    """The reentrant form keeps a layer's input for its recompute only: by the time the backward reaches the first
    layer, the inputs of the later ones are gone (a closure kept them to the end, a layer's worth of activations
    per two or three layers on the H200 workloads)."""
    import weakref

    from fastdpo.model.memory import apply_checkpointing

    m = small_model("qwen3")
    fuse_layers(m)
    apply_checkpointing(m, "full", reentrant=True)
    inputs, alive = [], []

    def keep(module, args, kwargs):
        inputs.append(weakref.ref(args[0] if args else kwargs["hidden_states"]))

    handles = [layer.register_forward_pre_hook(keep, with_kwargs=True) for layer in m.model.layers]
    ids = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(7))
    embeds = m.model.embed_tokens(ids)
    embeds.register_hook(lambda g: alive.append([r() is not None for r in inputs[1:]]))
    loss = m(inputs_embeds=embeds, use_cache=False).logits.float().log_softmax(-1)[..., 3].mean()
    for h in handles:
        h.remove()
    assert len(inputs) == len(m.model.layers) >= 2 and all(r() is not None for r in inputs)
    loss.backward()
    assert alive == [[False] * (len(inputs) - 1)]


def test_eager_layers_switch_the_kernels_off_inside_and_back_after():
    """The certificate's plain path: inside, every fused norm, MLP and attention runs torch's eager ops (no kernel is
    built for its shapes); the log-prob head keeps its kernels; after, each module is as it was, even on an error."""
    from fastdpo.model.fused import eager_layers

    model = small_model("qwen3")
    fuse_layers(model, use_kernels=True)
    fused_ = [m for m in model.modules() if hasattr(m, "_fastdpo_kernels") and m is not model.get_output_embeddings()]
    head = model.get_output_embeddings()
    assert fused_ and all(m._fastdpo_kernels for m in fused_) and head._fastdpo_kernels
    with pytest.raises(RuntimeError, match="inside"):
        with eager_layers(model):
            assert not any(m._fastdpo_kernels for m in fused_) and head._fastdpo_kernels
            raise RuntimeError("inside")
    assert all(m._fastdpo_kernels for m in fused_)
