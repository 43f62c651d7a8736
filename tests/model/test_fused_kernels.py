"""Fused models on the Triton kernels (`fastdpo.model.fused`, `fastdpo.model.lora` over `fastdpo.kernels`): loss,
log-probs and gradients against the plain float32 model, the head's, keys' and rotation's kernels where a model is
fused and nowhere else, and LoRA's dropout on the kernels' masks; under Triton's interpreter on the CPU and on a
CUDA stack of Qwen3's shapes (fewer bytes kept, checkpointing's recompute, the lean LoRA forward)."""

import copy

import pytest
import torch
from data_helpers import random_pairs
from gpu_helpers import logps_and_grads, qwen3
from interpreter_helpers import interpreted, rel, run_interpreted
from model_helpers import loss_and_grads, small_model

from fastdpo.data.pack import pack_pairs, pad_pairs, split_micro_batches
from fastdpo.kernels import logprob_head, rms_norm, rope, swiglu
from fastdpo.kernels import lora as lora_kernels
from fastdpo.model.backend import Backend, choose_backend, prepare_packed, sequence_logps
from fastdpo.model.fused import fuse_layers


def test_fused_models_under_the_interpreter():
    run_interpreted(__file__)


def spy(monkeypatch, calls: list, *where) -> None:
    """Note in `calls` the name of each function of `where` ((module, name) pairs) as it is called."""
    for module, name in where:
        fn = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _fn=fn, _n=name, **k: calls.append(_n) or _fn(*a, **k))


@interpreted
def test_the_head_runs_the_kernels_only_where_fused():
    from peft import LoraConfig, get_peft_model

    from fastdpo.model.backend import output_head

    m = small_model("qwen3")
    assert not output_head(m).kernels
    fuse_layers(m)
    assert not output_head(m).kernels  # the lean torch layers keep the eager head
    fuse_layers(m, use_kernels=True)
    assert output_head(m).kernels and output_head(copy.deepcopy(m)).kernels
    wrapped = get_peft_model(small_model("llama"), LoraConfig(r=4, target_modules=["q_proj"]))
    fuse_layers(wrapped, use_kernels=True)
    assert output_head(wrapped).kernels


@interpreted
def test_a_fused_model_s_sequence_log_probs_equal_the_float32_model_s(monkeypatch):
    """Completion log-prob sums and gradients of a fused bfloat16 model (norms, MLPs, rotary and the head on the
    kernels) against separate float32 forwards of the plain model, over padded pairs."""
    batch = pad_pairs(random_pairs(3, 128, seed=5))

    def run(m):
        m.zero_grad()
        seq, _ = sequence_logps(m, batch, Backend("padded"))
        (seq[:3] - seq[3:]).sum().backward()
        return seq.detach(), {n: p.grad.float() for n, p in m.named_parameters() if p.grad is not None}

    want, want_g = run(small_model("qwen3", torch.float32))
    m = small_model("qwen3", torch.bfloat16)
    fuse_layers(m, use_kernels=True)
    calls = []
    spy(monkeypatch, calls, (logprob_head, "logp_forward"), (logprob_head, "logp_backward_"))
    got, got_g = run(m)
    assert set(calls) == {"logp_forward", "logp_backward_"}
    assert rel(got, want) < 2e-2 and set(got_g) == set(want_g)
    for name in want_g:
        assert rel(got_g[name], want_g[name]) < 5e-2, name


@interpreted
def test_a_fused_model_through_the_packed_varlen_path_equals_the_plain_dense_path(model_dirs, monkeypatch):
    """Packed pairs through the varlen path (the kernel's float32 stand-in) on a model fused with the kernels (keys
    gathered with the kernel backward, the log-prob head's kernels) against the plain model's dense path."""
    from model_helpers import varlen_stand_in

    from fastdpo.kernels import gather_rows
    from fastdpo.model import attention
    from fastdpo.model.load import load_model

    monkeypatch.setattr(attention, "_varlen_kernel", varlen_stand_in)
    spied = []
    spy(monkeypatch, spied, (gather_rows, "gather_rows_backward"))
    results = []
    for fused, name in ((False, "dense"), (True, "varlen")):
        model = load_model(str(model_dirs("qwen3")), torch.float32, torch.device("cpu"))
        pairs = random_pairs(4, model.config.vocab_size, seed=4, max_prompt=8, max_comp=6)
        if fused:
            fuse_layers(model, use_kernels=True)
        backend = Backend(name)
        prepare_packed(model, backend)
        seq, _ = sequence_logps(model, pack_pairs(pairs, 1), backend)
        (seq * torch.linspace(0.5, 1.5, seq.numel())).sum().backward()
        results.append((seq.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (s_d, g_d), (s_v, g_v) = results
    assert spied, "the keys' kernel backward ran"
    torch.testing.assert_close(s_v, s_d, rtol=0, atol=1e-4)
    for n in g_d:
        assert rel(g_v[n], g_d[n]) < 1e-4, n


@interpreted
def test_a_model_outside_the_fused_one_keeps_the_plain_rotation(monkeypatch):
    """The modeling module's `apply_rotary_pos_emb` is shared by every model of its class: the kernel serves only
    inside a fused attention, and a plain model in the same process computes exactly what it did before."""
    import transformers.models.qwen3.modeling_qwen3 as modeling

    ids = torch.randint(0, 128, (1, 16), generator=torch.Generator().manual_seed(5))
    fused = small_model("qwen3", torch.bfloat16)
    fuse_layers(fused, use_kernels=True)
    patched = modeling.apply_rotary_pos_emb
    assert patched._fastdpo_plain is not patched
    plain = small_model("qwen3", torch.bfloat16)
    with torch.no_grad():
        got = plain(input_ids=ids).logits
        monkeypatch.setattr(modeling, "apply_rotary_pos_emb", patched._fastdpo_plain)
        want = plain(input_ids=ids).logits
    assert torch.equal(got, want)


@interpreted
@pytest.mark.parametrize("family", ["qwen3", "llama"])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 5e-2)])
def test_a_model_on_the_kernels_trains_as_the_float32_model(family, dtype, tol):
    ids = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(1))
    want_out, want = loss_and_grads(small_model(family, torch.float32), ids)
    m = small_model(family, dtype)
    assert set(fuse_layers(m, use_kernels=True)) >= {f"{'Qwen3' if family == 'qwen3' else 'Llama'}{k}"
                                                      for k in ("RMSNorm", "MLP")}
    calls = []
    with pytest.MonkeyPatch.context() as mp:
        spy(mp, calls, (rms_norm, "rms_norm_forward"), (rms_norm, "rms_norm_backward"), (swiglu, "silu_mul"),
            (swiglu, "silu_mul_backward"), (rope, "rope"))
        got_out, got = loss_and_grads(m, ids)
    assert {"rms_norm_forward", "rms_norm_backward", "silu_mul", "silu_mul_backward", "rope"} <= set(calls)
    assert rel(got_out, want_out) < tol
    assert set(got) == set(want)
    for name in want:
        assert rel(got[name], want[name]) < tol, name


@interpreted
def test_the_reference_copy_and_a_no_grad_forward_compute_the_same_numbers():
    """The reference is a deep copy of the fused policy: its forwards are bound to the copy, run the kernels, and
    give the policy's training forward bit for bit (the first step's log-ratios are exactly zero)."""
    ids = torch.randint(0, 128, (1, 20), generator=torch.Generator().manual_seed(3))
    m = small_model("qwen3", torch.bfloat16)
    fuse_layers(m, use_kernels=True)
    ref = copy.deepcopy(m).eval().requires_grad_(False)
    assert ref.model.norm.forward.__self__ is ref.model.norm and ref.model.norm._fastdpo_kernels
    train_out = m(input_ids=ids).logits
    with torch.no_grad():
        ref_out = ref(input_ids=ids).logits
    assert torch.equal(train_out, ref_out)


@interpreted
def test_lora_wrapping_the_down_projection_after_fusing_trains_its_adapter():
    from peft import LoraConfig, get_peft_model

    m = small_model("llama")
    fuse_layers(m, use_kernels=True)
    plain = small_model("llama")
    cfg = LoraConfig(r=4, lora_alpha=8, target_modules=["down_proj", "gate_proj"], init_lora_weights=False)
    m, plain = get_peft_model(m, cfg), get_peft_model(plain, copy.deepcopy(cfg))
    plain.load_state_dict(m.state_dict())
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(4))
    want_out, want = loss_and_grads(plain, ids)
    got_out, got = loss_and_grads(m, ids)
    assert any("down_proj.lora_A" in n for n in got)
    assert rel(got_out, want_out) < 1e-5
    for name in want:
        assert rel(got[name], want[name]) < 1e-5, name


@interpreted
def test_the_lean_lora_forward_applies_the_kernels_mask_from_torch_s_generator(model_dirs):
    """Where the kernels serve, the lean LoRA forward's dropout is theirs: the mask of a seed from torch's generator,
    the same in the backward; outputs and gradients equal the plain computation under that mask."""
    from lora_helpers import check_dropout_under_mask

    check_dropout_under_mask(model_dirs, lambda x: lora_kernels.lora_dropout_keep(
        lora_kernels.lora_dropout_seed(), tuple(x.shape), 0.3, x.device), atol=1e-5)


@interpreted
def test_lora_dropout_on_the_kernels_recomputes_the_forward_s_masks(model_dirs):
    """Full checkpointing (the reentrant form, which replays the generator) with LoRA dropout on the kernels: the
    same outputs and gradients as no checkpointing from the same seed, bit for bit; another seed differs."""
    from lora_helpers import ids_for, logits_and_grads, peft_model

    from fastdpo.model import lora
    from fastdpo.model.memory import apply_checkpointing

    def trained(policy, seed):
        m = peft_model(model_dirs, dropout=0.3)
        lora.fuse_lora(m)
        if policy != "none":
            apply_checkpointing(m, policy, reentrant=True)
        m.train()
        torch.manual_seed(seed)
        return logits_and_grads(m, ids_for(m))

    want_out, want = trained("none", 11)
    got_out, got = trained("full", 11)
    other_out, _ = trained("none", 12)
    assert not torch.equal(other_out, want_out)
    assert torch.equal(got_out, want_out)
    assert want.keys() == got.keys() and all(torch.equal(got[n], want[n]) for n in want)


@interpreted
def test_a_lean_mlp_s_lora_down_on_the_kernels_applies_their_mask_to_the_product(model_dirs):
    """The Triton MLP into a LoRA down projection with dropout: the product rebuilt by the kernel in the backward,
    the mask of a seed from torch's generator; outputs and gradients equal the plain computation under that mask."""
    from lora_helpers import check_mlp_dropout_under_mask

    check_mlp_dropout_under_mask(model_dirs, lambda h: lora_kernels.lora_dropout_keep(
        lora_kernels.lora_dropout_seed(), tuple(h.shape), 0.3, h.device), use_kernels=True, atol=1e-5)



@pytest.mark.gpu
def test_the_fused_layers_keep_fewer_bytes():
    def peak(model):
        pairs = random_pairs(8, 151936, seed=1, max_prompt=400, max_comp=400)
        backend = choose_backend(model, "auto", True, torch.device("cuda"))
        prepare_packed(model, backend)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        logps_and_grads(model, [pack_pairs(pairs, 1)], backend)
        return torch.cuda.max_memory_allocated() - base

    plain = peak(qwen3(torch.bfloat16).train())
    model = qwen3(torch.bfloat16).train()
    fuse_layers(model, use_kernels=True)
    assert peak(model) < 0.85 * plain


@pytest.mark.gpu
def test_full_checkpointing_in_the_reentrant_form_gives_the_gradients_of_none(monkeypatch):
    """Training's default on one GPU: every fused layer recomputed in the reentrant form (`memory._Recomputed`), the
    down projection skipped in the recompute; against the same bf16 stack without checkpointing, and both against
    float32."""
    from fastdpo.model import memory
    from fastdpo.model.memory import apply_checkpointing

    pairs = random_pairs(12, 151936, seed=1, max_prompt=300, max_comp=300)
    groups = split_micro_batches(pairs, 2048, 0)
    torch.backends.cuda.matmul.allow_tf32 = False
    slow, g_slow = logps_and_grads(qwen3(torch.float32), [pad_pairs(g) for g in groups], Backend("padded"))

    def fused():
        m = qwen3(torch.bfloat16).train()
        fuse_layers(m, use_kernels=True)
        backend = choose_backend(m, "auto", True, torch.device("cuda"))
        prepare_packed(m, backend)
        return m, backend

    plain, backend = fused()
    want, g_want = logps_and_grads(plain, [pack_pairs(g, 1) for g in groups], backend)
    model, backend = fused()
    apply_checkpointing(model, "full", reentrant=True)
    runs, apply = [], memory._Recomputed.apply
    monkeypatch.setattr(memory._Recomputed, "apply", lambda *a: runs.append(1) or apply(*a))
    got, g_got = logps_and_grads(model, [pack_pairs(g, 1) for g in groups], backend)
    assert len(runs) == len(groups) * len(model.model.layers)
    # the same layer kernels either way; only the per-sequence sums (index_add_) add their float32 terms with
    # atomics, in any order: a few ulps apart
    torch.testing.assert_close(got, want, rtol=2e-6, atol=0)
    assert max(rel(g_got[n], g_want[n]) for n in g_want) < 1e-2  # FlashAttention's backward adds with atomics
    assert max(rel(g_got[n], g_slow[n]) for n in g_slow) < 5e-2


@pytest.mark.gpu
@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_the_lean_lora_forward_on_cuda_is_as_close_to_float32_as_peft_s(dropout):
    """A bf16 Qwen3 stack with LoRA on every linear (float32 adapters, as PEFT casts them), through the varlen
    backend with full checkpointing: the lean LoRA forward against PEFT's own, both against float32."""
    from peft import LoraConfig, get_peft_model

    from fastdpo.model.lora import fuse_lora
    from fastdpo.model.memory import apply_checkpointing

    pairs = random_pairs(8, 151936, seed=3, max_prompt=300, max_comp=300)
    groups = split_micro_batches(pairs, 2048, 0)

    def build(dtype, fused):
        m = get_peft_model(qwen3(dtype), LoraConfig(r=16, lora_alpha=32, lora_dropout=dropout,
                                                    target_modules="all-linear"))
        g = torch.Generator(device="cuda").manual_seed(1)
        with torch.no_grad():
            for n, p in m.named_parameters():
                if "lora_B" in n:
                    p.copy_(0.02 * torch.randn(p.shape, device="cuda", generator=g))
        m.eval()  # dropout off for the comparison of values; the training mode's masks are checked below
        if fused:
            assert fuse_lora(m) == 7 * 4
        return m

    torch.backends.cuda.matmul.allow_tf32 = False
    slow, g_slow = logps_and_grads(build(torch.float32, False), [pad_pairs(g) for g in groups], Backend("padded"))
    out = {}
    for fused in (False, True):
        m = build(torch.bfloat16, fused)
        backend = choose_backend(m, "auto", True, torch.device("cuda"))
        prepare_packed(m, backend)
        apply_checkpointing(m, "full", reentrant=True)
        out[fused] = logps_and_grads(m, [pack_pairs(g, 1) for g in groups], backend)
    for fused in (False, True):
        assert rel(out[fused][0], slow) < 1e-2
    worst = {f: max(rel(out[f][1][n], g_slow[n]) for n in g_slow if "lora" in n) for f in (False, True)}
    assert worst[True] < 1.5 * worst[False] + 1e-2, worst
    if dropout:  # training mode: masks drawn in the forward, replayed by the recompute
        check_masks_replayed(lambda: build(torch.bfloat16, True).train(), groups, out[True][0])


def check_masks_replayed(build, groups, without_dropout):
    """A model from `build()` in training mode, with dropout: full checkpointing (reentrant) gives the log-probs of
    no checkpointing from the same seed (the recompute draws the forward's masks), and they differ from
    `without_dropout`'s."""
    from fastdpo.model.memory import apply_checkpointing

    runs = []
    for policy in ("none", "full"):
        m = build()
        backend = choose_backend(m, "auto", True, torch.device("cuda"))
        prepare_packed(m, backend)
        apply_checkpointing(m, policy, reentrant=True)
        torch.manual_seed(5)
        runs.append(logps_and_grads(m, [pack_pairs(g, 1) for g in groups], backend))
    (a, g_a), (b, g_b) = runs
    assert not torch.equal(a, without_dropout)  # dropout acted
    torch.testing.assert_close(b, a, rtol=2e-6, atol=0)
    assert max(rel(g_b[n], g_a[n]) for n in g_a) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_a_lean_mlp_s_lora_down_on_cuda_keeps_no_product_and_is_as_close_to_float32_as_peft_s(dropout, monkeypatch):
    """The Triton MLP feeding a LoRA down projection (the product rebuilt in the backward, dropout's mask drawn in
    the kernels) through the varlen backend with full checkpointing, whose recompute skips the base GEMM: as close
    to the float32 model as PEFT's own forward on the plain layers; in training mode, the recompute replays the
    forward's masks."""
    from peft import LoraConfig, get_peft_model

    from fastdpo.model.lora import fuse_lora
    from fastdpo.model.memory import apply_checkpointing

    pairs = random_pairs(8, 151936, seed=4, max_prompt=300, max_comp=300)
    groups = split_micro_batches(pairs, 2048, 0)

    def build(dtype, lean, train=False):
        base = qwen3(dtype)
        if lean:
            fuse_layers(base, use_kernels=True)
        m = get_peft_model(base, LoraConfig(r=16, lora_alpha=32, lora_dropout=dropout, target_modules="all-linear"))
        g = torch.Generator(device="cuda").manual_seed(1)
        with torch.no_grad():
            for n, p in m.named_parameters():
                if "lora_B" in n:
                    p.copy_(0.02 * torch.randn(p.shape, device="cuda", generator=g))
        if lean:
            fuse_lora(m)
        return m.train(train)

    calls = []
    apply = lora_kernels.SiluMulLoraDownFunction.apply
    monkeypatch.setattr(lora_kernels.SiluMulLoraDownFunction, "apply",
                        lambda *a: calls.append((a[-2], a[-1])) or apply(*a))
    torch.backends.cuda.matmul.allow_tf32 = False
    slow, g_slow = logps_and_grads(build(torch.float32, False), [pad_pairs(g) for g in groups], Backend("padded"))
    out = {}
    for lean in (False, True):
        m = build(torch.bfloat16, lean, train=True)
        if dropout:
            for mod in m.modules():  # dropout off for the comparison of values (the lean MLPs serve training)
                if isinstance(mod, torch.nn.Dropout):
                    mod.p = 0.0
        backend = choose_backend(m, "auto", True, torch.device("cuda"))
        prepare_packed(m, backend)
        apply_checkpointing(m, "full", reentrant=True)
        out[lean] = logps_and_grads(m, [pack_pairs(g, 1) for g in groups], backend)
    assert any(skip for _, skip in calls) and all(fast for fast, _ in calls)  # the kernels; the recompute skips
    for lean in (False, True):
        assert rel(out[lean][0], slow) < 1e-2
    worst = {f: max(rel(out[f][1][n], g_slow[n]) for n in g_slow if "lora" in n) for f in (False, True)}
    assert worst[True] < 1.5 * worst[False] + 1e-2, worst
    if dropout:
        check_masks_replayed(lambda: build(torch.bfloat16, True, train=True), groups, out[True][0])


@interpreted
def test_fp8_training_on_the_kernels_quantises_norms_and_products_as_they_are_written(monkeypatch):
    """--fp8 (row-wise) on a fused bfloat16 model: the norms' and the MLP product's kernels write their outputs in
    e4m3 as they write them, so only attention's output is quantised apart (once per layer, plus each trained
    weight); the log-probs and every gradient equal those of the same FP8 model quantising every input apart."""
    from fastdpo.kernels import fp8 as fp8_kernels
    from fastdpo.model.fp8 import convert_to_fp8_training

    batch = pad_pairs(random_pairs(2, 128, seed=7))

    def run(m):
        m.zero_grad()
        seq, _ = sequence_logps(m, batch, Backend("padded"))
        (seq[:2] - seq[2:]).sum().backward()
        return seq.detach(), {n: p.grad.float() for n, p in m.named_parameters()}

    fused = small_model("llama", torch.bfloat16)
    fuse_layers(fused, use_kernels=True)
    convert_to_fp8_training(fused)
    apart = copy.deepcopy(fused)
    for m in apart.modules():
        m.__dict__.pop("_fastdpo_fp8_out", None)
    calls = []
    spy(monkeypatch, calls, (fp8_kernels, "quantise_rowwise"))
    seq, grads = run(fused)
    layers = fused.config.num_hidden_layers
    # per layer: the o projection's input, the 7 weights, and the 7 output gradients of the backward
    assert len(calls) == (1 + 7 + 7) * layers
    calls.clear()
    want, want_grads = run(apart)
    assert len(calls) == (4 + 7 + 7) * layers  # q/k/v's, o's, gate/up's and down's inputs apart
    assert torch.equal(seq, want)
    for n, g in grads.items():
        assert torch.equal(g, want_grads[n]), n


@interpreted
def test_lora_on_an_fp8_base_fuses_and_trains_on_the_kernels_as_peft_s_own_forward():
    """LoRA over an FP8 base (--fp8_base) with the kernels: fusing probes the layers in the activations' dtype (not
    the base weights' float8, where the probe itself failed), the MLPs take the lean forward, and the loss and every
    adapter gradient equal PEFT's own forward over the same FP8 base (same adapters, checkpointing on)."""
    from peft import LoraConfig, get_peft_model

    from fastdpo.model.fp8 import convert_to_fp8_base
    from fastdpo.model.memory import apply_checkpointing

    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(3))
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]

    def run(fused):
        torch.manual_seed(0)
        m = small_model("qwen3", torch.bfloat16)
        convert_to_fp8_base(m)
        m = get_peft_model(m, LoraConfig(r=4, target_modules=targets, lora_dropout=0.0, init_lora_weights=False))
        names = fuse_layers(m, use_kernels=True) if fused else []
        apply_checkpointing(m, "full")
        m.train()
        out = m(input_ids=ids, use_cache=False).logits.float().log_softmax(-1).mean()  # no cache grown by recompute
        out.backward()
        return names, out.detach(), {n: p.grad.float() for n, p in m.named_parameters() if p.grad is not None}

    names, got, grads = run(True)
    assert "Qwen3MLP" in names and "Qwen3RMSNorm" in names
    _, want, want_grads = run(False)
    assert set(grads) == set(want_grads) and all("lora_" in n for n in grads)
    assert rel(got, want) < 1e-2
    for n, g in grads.items():  # bf16 on both sides, and an ulp apart an input can round to another e4m3 value
        assert rel(g, want_grads[n]) < 0.1, n
