"""The Triton kernels of the lean norms, MLPs, rotary embeddings and log-prob head (`fastdpo.model.kernels`) under Triton's
interpreter on the CPU: each against the plain float32 computation on random inputs (odd widths, row counts off the
block, no rows), and a fused model's loss and gradients against the plain model's, with LoRA wrapping the MLPs after
fusing; the AdamW update's kernel (`fastdpo.optim.adamw_kernel`) for the gradient scale it applies. Run by
tests/test_kernels.py in a process started with TRITON_INTERPRET=1 (Triton reads it as it is imported); the same
kernels compiled for CUDA are held to the same references in tests/test_gpu_kernels.py and tests/test_gpu.py."""

import copy

import pytest
import torch
import torch.nn.functional as F
from test_fused import loss_and_grads
from test_fused import model as tiny

from fastdpo.model import kernels
from fastdpo.model.fused import fuse_layers


@pytest.fixture(scope="module")
def K():
    assert kernels.INTERPRET and kernels.available(torch.zeros(1)), "run with TRITON_INTERPRET=1"
    return kernels


@pytest.fixture
def interpreted(K):
    return K


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-12)).item()


def norm_reference(x, w, eps):
    xf, wf = x.float().requires_grad_(), w.float().requires_grad_()
    return xf, wf, wf * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps))


@pytest.mark.parametrize("width", [128, 1000, 2048])
@pytest.mark.parametrize("rows", [1, 37])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
def test_rms_norm_forward_and_backward_equal_float32(K, width, rows, dtype, tol):
    g = torch.Generator().manual_seed(width + rows)
    x = (torch.randn(rows, width, generator=g) * 3).to(dtype)
    w = (1 + 0.2 * torch.randn(width, generator=g)).to(dtype)
    grad = torch.randn(rows, width, generator=g).to(dtype)
    y, rstd = K.rms_norm_forward(x, w, 1e-6)
    xf, wf, want = norm_reference(x, w, 1e-6)
    want.backward(grad.float())
    assert y.dtype == dtype and y.shape == x.shape and rstd.dtype == torch.float32
    assert rel(y, want) < tol
    assert rel(rstd, torch.rsqrt(x.float().pow(2).mean(-1) + 1e-6)) < 1e-6
    dx, dw = K.rms_norm_backward(grad, x, w, rstd, weight_grad=True)
    assert dx.dtype == dtype and dw.dtype == dtype
    assert rel(dx, xf.grad) < tol and rel(dw, wf.grad) < tol
    dx2, none = K.rms_norm_backward(grad, x, w, rstd, weight_grad=False)
    assert none is None and torch.equal(dx2, dx)


def test_rms_norm_of_a_head_view_and_of_no_rows(K):
    x = torch.randn(2, 5, 3, 16)  # (batch, tokens, heads, head_dim): Qwen3's per-head norms
    w = torch.rand(16) + 0.5
    y, _ = K.rms_norm_forward(x, w, 1e-6)
    assert y.shape == x.shape and rel(y, norm_reference(x, w, 1e-6)[2]) < 1e-6
    y0, r0 = K.rms_norm_forward(torch.zeros(0, 16), w, 1e-6)
    assert y0.shape == (0, 16) and r0.shape == (0,)
    dx, dw = K.rms_norm_backward(torch.zeros(0, 16), torch.zeros(0, 16), w, r0, weight_grad=True)
    assert dx.shape == (0, 16) and torch.equal(dw, torch.zeros(16))


@pytest.mark.parametrize("numel", [1, 333, 5000])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
def test_silu_mul_forward_and_backward_equal_float32(K, numel, dtype, tol):
    g = torch.Generator().manual_seed(numel)
    a, b, grad = (torch.randn(numel, generator=g).mul(3).to(dtype) for _ in range(3))
    af, bf = a.float().requires_grad_(), b.float().requires_grad_()
    want = F.silu(af) * bf
    want.backward(grad.float())
    p = K.silu_mul(a, b)
    assert p.dtype == dtype and rel(p, want) < tol
    if dtype == torch.float32:
        assert torch.allclose(p, F.silu(a) * b, atol=1e-6)
    da, db, again = K.silu_mul_backward(a, b, grad, product=True)
    assert rel(da, af.grad) < tol and rel(db, bf.grad) < tol
    assert torch.equal(again, p)  # the product rebuilt in the backward is the forward's
    assert K.silu_mul_backward(a, b, grad)[2] is None


def head_reference(h, w, t, scale):
    hf, wf = h.detach().float().requires_grad_(), w.detach().float().requires_grad_()
    return hf, wf, torch.log_softmax((hf @ wf.t()) * scale, -1).gather(1, t[:, None]).squeeze(1)


@pytest.mark.parametrize("rows,vocab,chunk", [(1, 100, 1024), (37, 5000, 16), (0, 300, 16)])
@pytest.mark.parametrize("dtype,scale,tol", [(torch.float32, 1.0, 1e-5), (torch.bfloat16, 0.5, 2e-2)])
def test_log_prob_head_kernels_equal_float32(K, monkeypatch, rows, vocab, chunk, dtype, scale, tol):
    """Target log-probs and both gradients through the kernels (a vocabulary over one block of the kernels and
    under it, chunks off the row count, no rows) against float32 autograd, and the kernels were what ran."""
    from fastdpo.model.logprobs import token_logps

    g = torch.Generator().manual_seed(rows + vocab)
    h = torch.randn(rows, 16, generator=g).mul(2).to(dtype).requires_grad_()
    w = torch.randn(vocab, 16, generator=g).to(dtype).requires_grad_()
    t = torch.randint(0, vocab, (rows,), generator=g)
    up = torch.randn(rows, generator=g)
    calls = []
    for name in ("logp_forward", "logp_backward_"):
        fn = getattr(K, name)
        monkeypatch.setattr(K, name, lambda *a, _fn=fn, _n=name: calls.append(_n) or _fn(*a))
    got = token_logps(h, w, t, chunk=chunk, scale=scale, kernels=True)
    (got * up).sum().backward()
    hf, wf, want = head_reference(h, w, t, scale)
    (want * up).sum().backward()
    assert got.dtype == torch.float32 and got.shape == (rows,)
    if rows:
        assert set(calls) == {"logp_forward", "logp_backward_"}
        assert rel(got, want) < tol and rel(h.grad, hf.grad) < tol and rel(w.grad, wf.grad) < tol
        plain = token_logps(h.detach(), w.detach(), t, chunk=chunk, scale=scale)  # the eager path: the same numbers
        assert (got.detach() - plain).abs().max() < 1e-4 * max(1.0, plain.abs().max().item())
    else:
        assert not w.grad.abs().any()


def test_the_head_runs_the_kernels_only_where_fused(K):
    from peft import LoraConfig, get_peft_model

    from fastdpo.model.backend import output_head

    m = tiny("qwen3")
    assert not output_head(m).kernels
    fuse_layers(m)
    assert not output_head(m).kernels  # the lean torch layers keep the eager head
    fuse_layers(m, use_kernels=True)
    assert output_head(m).kernels and output_head(copy.deepcopy(m)).kernels
    wrapped = get_peft_model(tiny("llama"), LoraConfig(r=4, target_modules=["q_proj"]))
    fuse_layers(wrapped, use_kernels=True)
    assert output_head(wrapped).kernels


def test_a_fused_model_s_sequence_log_probs_equal_the_float32_model_s(K, monkeypatch):
    """Completion log-prob sums and gradients of a fused bfloat16 model (norms, MLPs, rotary and the head on the
    kernels) against separate float32 forwards of the plain model, over padded pairs."""
    from conftest import random_pairs

    from fastdpo.data.pack import pad_pairs
    from fastdpo.model.backend import Backend, sequence_logps

    batch = pad_pairs(random_pairs(3, 128, seed=5))

    def run(m):
        m.zero_grad()
        seq, _ = sequence_logps(m, batch, Backend("padded"))
        (seq[:3] - seq[3:]).sum().backward()
        return seq.detach(), {n: p.grad.float() for n, p in m.named_parameters() if p.grad is not None}

    want, want_g = run(tiny("qwen3", torch.float32))
    m = tiny("qwen3", torch.bfloat16)
    fuse_layers(m, use_kernels=True)
    calls = []
    for name in ("logp_forward", "logp_backward_"):
        fn = getattr(K, name)
        monkeypatch.setattr(K, name, lambda *a, _fn=fn, _n=name: calls.append(_n) or _fn(*a))
    got, got_g = run(m)
    assert set(calls) == {"logp_forward", "logp_backward_"}
    assert rel(got, want) < 2e-2 and set(got_g) == set(want_g)
    for name in want_g:
        assert rel(got_g[name], want_g[name]) < 5e-2, name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gathered_keys_backward_sums_each_token_s_two_rows(K, dtype):
    """Keys gathered per sequence through `attention.gather_keys` on a fused attention: the forward is index_select
    and the backward, one kernel pass without atomics, equals index_select's (index_add) in float32."""
    from types import SimpleNamespace

    from fastdpo.model import attention

    lens, total = [(3, 2, 4), (0, 3, 2), (6, 1, 1)], 25
    key_index, *_ = attention.varlen_layout(lens, total)
    first, second = attention.key_sources(lens, total)
    kw = {"fastdpo_key_first": torch.tensor(first), "fastdpo_key_second": torch.tensor(second)}
    index = torch.tensor(key_index)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(total, 3, 40, generator=g).to(dtype).requires_grad_()
    up = torch.randn(len(key_index), 3, 40, generator=g).to(dtype)
    y = attention.gather_keys(SimpleNamespace(_fastdpo_kernels=True), x, index, kw)
    y.backward(up)
    xf = x.detach().float().requires_grad_()
    want = xf.index_select(0, index)
    want.backward(up.float())
    assert torch.equal(y.detach(), x.detach().index_select(0, index))
    assert rel(x.grad, xf.grad) < (1e-6 if dtype == torch.float32 else 1e-2)
    plain = attention.gather_keys(SimpleNamespace(), x, index, kw)  # not a fused attention: index_select's own
    assert plain.grad_fn.name().startswith("IndexSelect") and not y.grad_fn.name().startswith("IndexSelect")


def test_a_fused_model_through_the_packed_varlen_path_equals_the_plain_dense_path(interpreted, model_dirs,
                                                                                   monkeypatch):
    """Packed pairs through the varlen path (the kernel's float32 stand-in) on a model fused with the kernels (keys
    gathered with the kernel backward, the log-prob head's kernels) against the plain model's dense path."""
    from conftest import random_pairs
    from test_varlen import stand_in

    from fastdpo.data.pack import pack_pairs
    from fastdpo.model import attention
    from fastdpo.model.backend import Backend, prepare_packed, sequence_logps
    from fastdpo.model.load import load_model

    monkeypatch.setattr(attention, "_varlen_kernel", stand_in)
    spied = []
    fn = interpreted.gather_rows_backward
    monkeypatch.setattr(interpreted, "gather_rows_backward", lambda *a: spied.append(1) or fn(*a))
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


class _LaunchLog:
    """Stands in for the jitted kernels' module and records each launch's kernel, argument dtypes and compile-time
    constants (what makes Triton build a kernel anew, short of integer specialisation) before launching it."""

    def __init__(self, real, seen: set):
        self.real, self.seen = real, seen

    def __getattr__(self, name):
        kernel = getattr(self.real, name)

        class Grid:
            def __getitem__(_, grid):
                def launch(*args, **kw):
                    dtypes = tuple(str(a.dtype) for a in args if isinstance(a, torch.Tensor))
                    self.seen.add((name, dtypes, tuple(sorted(kw.items()))))
                    return kernel[grid](*args, **kw)
                return launch
        return Grid()


@pytest.mark.parametrize("lora", [False, True])
def test_the_builds_ahead_are_the_builds_training_uses(K, model_dirs, monkeypatch, lora):
    """Every kernel a fused model launches in training (the varlen path's stand-in, policy forward and backward, a
    no-grad forward; full fine-tuning, or LoRA with dropout on every linear layer) was built ahead by `_launches` for that model's
    config: same kernel, argument dtypes and constants. A launch with other constants would be built again in the
    first step."""
    from conftest import random_pairs
    from test_varlen import stand_in

    from fastdpo.data.pack import pack_pairs
    from fastdpo.model import attention
    from fastdpo.model.backend import Backend, prepare_packed, sequence_logps
    from fastdpo.model.load import load_model

    monkeypatch.setattr(attention, "_varlen_kernel", stand_in)
    real = K.jitted()
    model = load_model(str(model_dirs("qwen3")), torch.bfloat16, torch.device("cpu"))
    fuse_layers(model, use_kernels=True)
    if lora:
        from peft import LoraConfig, get_peft_model

        from fastdpo.model.lora import fuse_lora

        model = get_peft_model(model, LoraConfig(r=4, lora_dropout=0.1, target_modules="all-linear")).train()
        assert fuse_lora(model)
    built, used = set(), set()
    monkeypatch.setattr(K, "jitted", lambda: _LaunchLog(real, built))
    config = model.config
    for launch in K._launches(K.norm_widths(config), torch.bfloat16, torch.device("cpu"), K.head_size(config),
                              lora=lora, dropout_rank=4 if lora else 0):
        launch()
    monkeypatch.setattr(K, "jitted", lambda: _LaunchLog(real, used))
    backend = Backend("varlen")
    prepare_packed(model, backend)
    batch = pack_pairs(random_pairs(3, model.config.vocab_size, seed=6), 1)
    seq, _ = sequence_logps(model, batch, backend)
    seq.sum().backward()
    with torch.no_grad():
        sequence_logps(model, batch, backend)
    assert {name for name, *_ in used} >= {"_rms_fwd", "_rms_bwd", "_silu_mul_fwd", "_silu_mul_bwd", "_rope",
                                            "_logp_fwd", "_logp_bwd", "_gather_rows_bwd"}
    if lora:  # the adapters' dropout on its kernels
        assert {name for name, *_ in used} >= {"_lora_drop_down", "_lora_drop_dx", "_lora_drop_da"}
    assert used <= built, sorted(used - built)


def rope_reference(x, cos, sin):
    half = x.shape[-1] // 2
    return x * cos[:, None] + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin[:, None]


@pytest.mark.parametrize("batch,tokens,heads,head_dim,cos_batch", [(1, 37, 3, 16, 1), (2, 5, 2, 12, 2),
                                                                   (2, 19, 1, 128, 1)])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
def test_rope_forward_and_backward_equal_float32(K, batch, tokens, heads, head_dim, cos_batch, dtype, tol):
    g = torch.Generator().manual_seed(tokens * heads + head_dim)
    x = torch.randn(batch, tokens, heads, head_dim, generator=g).to(dtype).transpose(1, 2)  # the projections' layout
    angles = torch.randn(cos_batch, tokens, head_dim // 2, generator=g).mul(3).repeat(1, 1, 2)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    grad = torch.randn(batch, heads, tokens, head_dim, generator=g).to(dtype)
    xf = x.float().requires_grad_()
    want = rope_reference(xf, cos.float(), sin.float())
    want.backward(grad.float())
    y = K.rope(x, cos, sin)
    assert y.dtype == dtype and y.shape == x.shape and rel(y, want) < tol
    assert y.transpose(1, 2).is_contiguous()  # laid out as (B, S, H, D), as the attention reads it
    dx = K.rope(grad, cos, sin, backward=True)
    assert dx.shape == x.shape and rel(dx, xf.grad) < tol
    assert K.rope(x[:, :, :0], cos[:, :0], sin[:, :0]).shape == (batch, heads, 0, head_dim)


def test_a_model_outside_the_fused_one_keeps_the_plain_rotation(interpreted, monkeypatch):
    """The modeling module's `apply_rotary_pos_emb` is shared by every model of its class: the kernel serves only
    inside a fused attention, and a plain model in the same process computes exactly what it did before."""
    import transformers.models.qwen3.modeling_qwen3 as modeling

    ids = torch.randint(0, 128, (1, 16), generator=torch.Generator().manual_seed(5))
    fused = tiny("qwen3", torch.bfloat16)
    fuse_layers(fused, use_kernels=True)
    patched = modeling.apply_rotary_pos_emb
    assert patched._fastdpo_plain is not patched
    plain = tiny("qwen3", torch.bfloat16)
    with torch.no_grad():
        got = plain(input_ids=ids).logits
        monkeypatch.setattr(modeling, "apply_rotary_pos_emb", patched._fastdpo_plain)
        want = plain(input_ids=ids).logits
    assert torch.equal(got, want)


@pytest.mark.parametrize("family", ["qwen3", "llama"])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 5e-2)])
def test_a_model_on_the_kernels_trains_as_the_float32_model(interpreted, family, dtype, tol):
    ids = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(1))
    want_out, want = loss_and_grads(tiny(family, torch.float32), ids)
    m = tiny(family, dtype)
    assert set(fuse_layers(m, use_kernels=True)) >= {f"{'Qwen3' if family == 'qwen3' else 'Llama'}{k}"
                                                      for k in ("RMSNorm", "MLP")}
    calls = []
    with pytest.MonkeyPatch.context() as mp:
        for name in ("rms_norm_forward", "rms_norm_backward", "silu_mul", "silu_mul_backward", "rope"):
            fn = getattr(interpreted, name)
            mp.setattr(interpreted, name, lambda *a, _fn=fn, _n=name, **k: calls.append(_n) or _fn(*a, **k))
        got_out, got = loss_and_grads(m, ids)
    assert {"rms_norm_forward", "rms_norm_backward", "silu_mul", "silu_mul_backward", "rope"} <= set(calls)
    assert rel(got_out, want_out) < tol
    assert set(got) == set(want)
    for name in want:
        assert rel(got[name], want[name]) < tol, name


def test_the_reference_copy_and_a_no_grad_forward_compute_the_same_numbers(interpreted):
    """The reference is a deep copy of the fused policy: its forwards are bound to the copy, run the kernels, and
    give the policy's training forward bit for bit (the first step's log-ratios are exactly zero)."""
    ids = torch.randint(0, 128, (1, 20), generator=torch.Generator().manual_seed(3))
    m = tiny("qwen3", torch.bfloat16)
    fuse_layers(m, use_kernels=True)
    ref = copy.deepcopy(m).eval().requires_grad_(False)
    assert ref.model.norm.forward.__self__ is ref.model.norm and ref.model.norm._fastdpo_kernels
    train_out = m(input_ids=ids).logits
    with torch.no_grad():
        ref_out = ref(input_ids=ids).logits
    assert torch.equal(train_out, ref_out)


def test_lora_wrapping_the_down_projection_after_fusing_trains_its_adapter(interpreted):
    from peft import LoraConfig, get_peft_model

    m = tiny("llama")
    fuse_layers(m, use_kernels=True)
    plain = tiny("llama")
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


def test_ready_waits_for_the_build_and_a_failed_build_turns_the_kernels_off(K, monkeypatch):
    monkeypatch.setattr(K, "_builds", {})
    monkeypatch.setattr(K, "_failed", [])
    thread = K.build_ahead([64, 16], torch.bfloat16, torch.device("cpu"), 16)
    assert thread is not None and K.build_ahead([64, 16], torch.bfloat16, torch.device("cpu"), 16) is thread
    assert K.ready([64, 16], torch.bfloat16, torch.device("cpu"), 16) is None and K.available(torch.zeros(1))

    def broken(*a):
        raise RuntimeError("ptxas fatal: unsupported architecture\nmore")

    monkeypatch.setattr(K, "_build", broken)
    why = K.ready([32], torch.bfloat16, torch.device("cpu"))
    assert why == "RuntimeError: ptxas fatal: unsupported architecture"
    assert not K.available(torch.zeros(1))  # nothing uses them once a build failed


def test_launches_are_pruned_to_the_kind_of_training(K):
    def kinds(lora):
        return sorted((f.func.__name__, f.args[-1]) for f in K._launches([32], torch.float32, torch.device("cpu"), 8, lora)
                      if f.func.__name__ in ("rms_norm_backward", "silu_mul_backward"))

    assert kinds(False) == [("rms_norm_backward", True), ("silu_mul_backward", True)]  # full: weights train, plain down
    assert kinds(True) == [("rms_norm_backward", False), ("silu_mul_backward", False), ("silu_mul_backward", True)]
    assert len(kinds(None)) == 4


def lora_reference(x, a, gt, keep, p, scale):
    """The adapter's dropped product and its two gradients, in float32 from the same inputs and mask."""
    xd = x.float() * keep / (1 - p)
    return xd @ a.float().t(), (gt.float() @ a.float()) * keep * (scale / (1 - p)), gt.float().t() @ xd


@pytest.mark.parametrize("rows,width,rank", [(37, 200, 8), (70, 130, 16), (5, 64, 24), (0, 64, 8)])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_lora_dropout_kernels_equal_float32_under_their_own_mask(K, rows, width, rank, dtype, tol):
    g = torch.Generator().manual_seed(rows + width + rank)
    x = torch.randn(rows, width, generator=g).to(dtype)
    a = (0.1 * torch.randn(rank, width, generator=g)).to(dtype)
    gt = torch.randn(rows, rank, generator=g).to(dtype)
    p, seed = 0.3, 1234 + rows
    keep = K.lora_dropout_keep(seed, (rows, width), p, x.device)
    t = K.lora_dropout_down(x, a, seed, p)
    dx = K.lora_dropout_input_grad(gt, a, seed, p, 2.0)
    da = K.lora_dropout_weight_grad(gt, x, seed, p)
    want_t, want_dx, want_da = lora_reference(x, a, gt, keep, p, 2.0)
    assert t.dtype == dtype and dx.dtype == dtype and da.dtype == torch.float32
    assert t.shape == (rows, rank) and dx.shape == (rows, width) and da.shape == (rank, width)
    if rows:
        assert rel(t, want_t) < tol and rel(dx, want_dx) < tol and rel(da, want_da) < tol
        assert torch.equal(dx == 0, ~keep | (want_dx == 0))  # the backward drops where the forward dropped
    else:
        assert not da.any()


def test_lora_dropout_masks_keep_one_minus_p_and_follow_the_seed(K):
    shape = (300, 1000)
    for p in (0.05, 0.5):
        keep = K.lora_dropout_keep(7, shape, p, torch.device("cpu"))
        assert abs(keep.float().mean().item() - (1 - p)) < 0.01
    a, b = (K.lora_dropout_keep(s, shape, 0.5, torch.device("cpu")) for s in (7, 8))
    assert torch.equal(a, K.lora_dropout_keep(7, shape, 0.5, torch.device("cpu"))) and not torch.equal(a, b)
    assert abs((a == b).float().mean().item() - 0.5) < 0.01  # another seed: an independent mask
    rows = a.view(300, 1000)
    assert not torch.equal(rows[0], rows[1])  # nor one mask repeated row after row
    # the two halves of a word, and neighbouring words, decide independently: neighbours agree half the time
    for step in (1, 2, 8):
        assert abs((rows[:, step:] == rows[:, :-step]).float().mean().item() - 0.5) < 0.01, step
    # the forward applies exactly that mask: through an identity adapter, dropout(x) itself comes out
    x = torch.rand(64, 16) + 1
    t = K.lora_dropout_down(x, torch.eye(16), 9, 0.25)
    torch.testing.assert_close(t, x * K.lora_dropout_keep(9, (64, 16), 0.25, x.device) / 0.75)


def test_the_lean_lora_forward_applies_the_kernels_mask_from_torch_s_generator(interpreted, model_dirs):
    """Where the kernels serve, the lean LoRA forward's dropout is theirs: the mask of a seed from torch's generator,
    the same in the backward; outputs and gradients equal the plain computation under that mask."""
    from test_lora_fused import check_dropout_under_mask

    check_dropout_under_mask(model_dirs, lambda x: interpreted.lora_dropout_keep(
        interpreted.lora_dropout_seed(), tuple(x.shape), 0.3, x.device), atol=1e-5)


def test_lora_dropout_on_the_kernels_recomputes_the_forward_s_masks(interpreted, model_dirs):
    """Full checkpointing (the reentrant form, which replays the generator) with LoRA dropout on the kernels: the
    same outputs and gradients as no checkpointing from the same seed, bit for bit; another seed differs."""
    from test_lora_fused import ids_for, peft_model, run

    from fastdpo.model import lora
    from fastdpo.model.memory import apply_checkpointing

    def trained(policy, seed):
        m = peft_model(model_dirs, dropout=0.3)
        lora.fuse_lora(m)
        if policy != "none":
            apply_checkpointing(m, policy, reentrant=True)
        m.train()
        torch.manual_seed(seed)
        return run(m, ids_for(m))

    want_out, want = trained("none", 11)
    got_out, got = trained("full", 11)
    other_out, _ = trained("none", 12)
    assert not torch.equal(other_out, want_out)
    assert torch.equal(got_out, want_out)
    assert want.keys() == got.keys() and all(torch.equal(got[n], want[n]) for n in want)


def test_a_lean_mlp_s_lora_down_on_the_kernels_applies_their_mask_to_the_product(interpreted, model_dirs):
    """The Triton MLP into a LoRA down projection with dropout: the product rebuilt by the kernel in the backward,
    the mask of a seed from torch's generator; outputs and gradients equal the plain computation under that mask."""
    from test_lora_fused import check_mlp_dropout_under_mask

    check_mlp_dropout_under_mask(model_dirs, lambda h: interpreted.lora_dropout_keep(
        interpreted.lora_dropout_seed(), tuple(h.shape), 0.3, h.device), use_kernels=True, atol=1e-5)


def test_the_adamw_kernel_scales_the_gradients_it_reads(K):
    """The update's kernel multiplies each gradient by `scale` (clipping's coefficient) as it loads it: the bits of
    gradients scaled beforehand in float32 (bfloat16 weights rounded stochastically, and float32 ones), the
    gradients left as they were, and the foreach path's update with the same scale."""
    from fastdpo.optim.adamw import _foreach_steps
    from fastdpo.optim.adamw_kernel import adamw_update_

    g = torch.Generator().manual_seed(0)
    ok, coef = torch.ones(1, dtype=torch.bool), torch.tensor([0.0123])
    for dtype, stochastic in ((torch.bfloat16, True), (torch.float32, False)):
        kw = dict(lr=1e-3, weight_decay=0.1, b1=0.9, b2=0.999, step=3, eps=1e-8, seeds=[11, 12], stochastic=stochastic)
        ws = [(torch.randn(n, generator=g) * 0.02).to(dtype) for n in (9001, 300)]
        start = [ws, [torch.randn(w.shape, generator=g).to(dtype) for w in ws],
                 [(torch.randn(w.shape, generator=g) * 1e-3).to(dtype) for w in ws],
                 [(torch.rand(w.shape, generator=g) * 1e-6).to(dtype) for w in ws]]
        scaled, pre, plain = ([[t.clone() for t in lst] for lst in start] for _ in range(3))
        pre[1] = [(t.float() * coef).to(torch.float32) for t in pre[1]]
        adamw_update_(*scaled, ok, scale=coef, **kw)
        adamw_update_(*pre, ok, **kw)
        adamw_update_(*plain, ok, **kw)
        for a, b in zip(scaled[0] + scaled[2] + scaled[3], pre[0] + pre[2] + pre[3]):
            assert torch.equal(a, b)
        assert all(torch.equal(a, b) for a, b in zip(scaled[1], start[1]))
        assert not torch.equal(scaled[2][0], plain[2][0])  # the scale changed the moments
        if dtype == torch.float32:
            ref = [[t.clone() for t in lst] for lst in start]
            group = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)
            _foreach_steps(ref, group, 3, None, coef.reshape(()))
            for a, b in zip(scaled[0] + scaled[2] + scaled[3], ref[0] + ref[2] + ref[3]):
                torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-9)
