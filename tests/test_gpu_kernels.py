"""The Triton norms, MLPs, rotary embeddings and log-prob head compiled for CUDA: each kernel against the float32 computation at
the real models' widths, a fused Qwen3 stack against the float32 padded reference through the varlen backend, one build per width
whatever the number of tokens, and fewer bytes kept than the plain layers. Run on a CUDA device:
`pytest -m gpu tests/test_gpu_kernels.py`."""

import pytest
import torch
import torch.nn.functional as F
from conftest import random_pairs
from test_gpu_varlen import logps_and_grads, qwen3, rel

from fastdpo.data.pack import pack_pairs, pad_pairs, split_micro_batches
from fastdpo.model import kernels
from fastdpo.model.backend import Backend, choose_backend, prepare_packed, sequence_logps
from fastdpo.model.fused import fuse_layers

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("width", [128, 2048, 4096, 5120])
@pytest.mark.parametrize("rows", [1, 3001])
def test_rms_norm_kernels_equal_float32(width, rows):
    g = torch.Generator(device="cuda").manual_seed(width)
    x = torch.randn(rows, width, device="cuda", generator=g).mul(3).bfloat16()
    w = (1 + 0.2 * torch.randn(width, device="cuda", generator=g)).bfloat16()
    grad = torch.randn(rows, width, device="cuda", generator=g).bfloat16()
    xf, wf = x.float().requires_grad_(), w.float().requires_grad_()
    want = wf * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6))
    want.backward(grad.float())
    y, rstd = kernels.rms_norm_forward(x, w, 1e-6)
    dx, dw = kernels.rms_norm_backward(grad, x, w, rstd, weight_grad=True)
    assert rel(y, want) < 1e-2 and rel(dx, xf.grad) < 1e-2 and rel(dw, wf.grad) < 1e-2
    plain = w * (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)).bfloat16()
    assert (y.float() - plain.float()).abs().max() <= plain.float().abs().max() * 2**-7  # eager's result but an ulp


def test_direct_launches_serve_misaligned_views_and_other_counts_as_triton_s_dispatch_would():
    """Each kernel is compiled on its first launch for what that launch's arguments allow (16-byte aligned
    pointers, counts that are multiples of 16); later launches skip Triton's dispatch. Views at odd offsets and
    other counts, in turn with aligned ones, must still give the float32 result."""
    assert kernels._direct_launches(), "this Triton's dispatch is not the one `kernels.launch` repeats"
    g = torch.Generator(device="cuda").manual_seed(0)
    width = 2048
    base = torch.randn(70 * width + 8, device="cuda", generator=g).mul(2).bfloat16()
    w = (1 + 0.2 * torch.randn(width, device="cuda", generator=g)).bfloat16()
    runs = [(64, 0), (64, 0), (37, 0), (64, 3), (64, 3), (1, 5), (48, 0), (33, 1)]
    for rows, offset in runs:
        x = base[offset:offset + rows * width].view(rows, width)  # odd offsets: 2-byte aligned only
        y, _ = kernels.rms_norm_forward(x, w, 1e-6)
        xf = x.float()
        assert rel(y, w.float() * xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)) < 1e-2, (rows, offset)
        a, b = x.reshape(-1), base[-rows * width:]
        p = kernels.silu_mul(a, b)
        assert rel(p, F.silu(a.float()) * b.float()) < 1e-2, (rows, offset)
    rms = kernels.jitted()._rms_fwd
    served = [k for k in kernels._compiled if k[0] is rms]
    assert any((torch.bfloat16, False) in k for k in served) and any((torch.bfloat16, True) in k for k in served)


@pytest.mark.parametrize("width,rank", [(4096, 16), (12288, 8), (2048, 64)])
@pytest.mark.parametrize("rows", [1, 3001])
@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 1e-2), (torch.float32, 1e-5)])
def test_lora_dropout_kernels_equal_float32_under_their_mask(width, rank, rows, dtype, tol):
    """The adapter's dropped product and both gradients at real widths, against float32 under the kernels' own
    mask; the dropped input rounds as torch's x * mask / (1 - p) does. Float32 inputs are multiplied in full
    precision (no TF32)."""
    g = torch.Generator(device="cuda").manual_seed(width + rank + rows)
    x = torch.randn(rows, width, device="cuda", generator=g).to(dtype)
    a = (0.02 * torch.randn(rank, width, device="cuda", generator=g)).to(dtype)
    gt = torch.randn(rows, rank, device="cuda", generator=g).to(dtype)
    p, seed = 0.05, 99 + rows
    keep = kernels.lora_dropout_keep(seed, (rows, width), p, x.device)
    assert abs(keep.float().mean().item() - (1 - p)) < (0.01 if rows > 1 else 0.05)
    t = kernels.lora_dropout_down(x, a, seed, p)
    dx = kernels.lora_dropout_input_grad(gt, a, seed, p, 2.0)
    da = kernels.lora_dropout_weight_grad(gt, x, seed, p)
    xd = x * keep * (1.0 / (1.0 - p))  # torch's rounding of the dropped input
    f64 = {"dtype": torch.float64}
    assert rel(t, xd.to(**f64) @ a.to(**f64).t()) < tol
    assert rel(dx, (gt.to(**f64) @ a.to(**f64)) * keep * (2.0 / (1 - p))) < tol
    assert rel(da, gt.to(**f64).t() @ xd.to(**f64)) < 1e-4  # float32 sums of the very products (TF32: ~1e-3)
    assert torch.equal(dx == 0, ~keep | (dx == 0))


@pytest.mark.parametrize("numel", [1, 6144 * 3001 + 7])
def test_silu_mul_kernels_equal_float32(numel):
    g = torch.Generator(device="cuda").manual_seed(numel)
    a, b, grad = (torch.randn(numel, device="cuda", generator=g).mul(3).bfloat16() for _ in range(3))
    af, bf = a.float().requires_grad_(), b.float().requires_grad_()
    want = F.silu(af) * bf
    want.backward(grad.float())
    p = kernels.silu_mul(a, b)
    assert torch.equal(p, F.silu(a) * b)  # eager's rounding exactly
    da, db, again = kernels.silu_mul_backward(a, b, grad, product=True)
    assert rel(da, af.grad) < 1e-2 and rel(db, bf.grad) < 1e-2 and torch.equal(again, p)


@pytest.mark.parametrize("heads,head_dim", [(16, 128), (8, 128), (32, 64)])
@pytest.mark.parametrize("tokens", [1, 3001])
def test_rope_kernels_equal_float32(heads, head_dim, tokens):
    g = torch.Generator(device="cuda").manual_seed(tokens + heads)
    x = torch.randn(1, tokens, heads, head_dim, device="cuda", generator=g).bfloat16().transpose(1, 2)
    angles = torch.rand(1, tokens, head_dim // 2, device="cuda", generator=g).mul(50).repeat(1, 1, 2)
    cos, sin = angles.cos().bfloat16(), angles.sin().bfloat16()
    grad = torch.randn(1, tokens, heads, head_dim, device="cuda", generator=g).bfloat16().transpose(1, 2)
    xf = x.float().requires_grad_()
    half = head_dim // 2
    want = xf * cos.float()[:, None] + torch.cat((-xf[..., half:], xf[..., :half]), -1) * sin.float()[:, None]
    want.backward(grad.float())
    y, dx = kernels.rope(x, cos, sin), kernels.rope(grad, cos, sin, backward=True)
    assert rel(y, want) < 1e-2 and rel(dx, xf.grad) < 1e-2 and y.transpose(1, 2).is_contiguous()


def built(fn) -> int:
    """Kernels Triton has built for the jitted `fn` (its per-device caches; older releases call them `cache`)."""
    caches = getattr(fn, "device_caches", None)
    if caches is not None:
        return sum(len(c[0]) for c in caches.values())
    return sum(len(c) for c in fn.cache.values())


KERNELS = ("_rms_fwd", "_rms_bwd", "_silu_mul_fwd", "_silu_mul_bwd", "_rope")


@pytest.mark.parametrize("rows", [1, 2500])
def test_log_prob_head_kernels_equal_float32_at_a_real_vocabulary(rows):
    """Qwen3's 151,936-wide head: target log-probs and both gradients through the kernels against float32 autograd,
    and the log-probs against the eager bfloat16 path's."""
    from fastdpo.model.logprobs import token_logps

    g = torch.Generator(device="cuda").manual_seed(rows)
    h = torch.randn(rows, 2048, device="cuda", generator=g).bfloat16().requires_grad_()
    w = (torch.randn(151936, 2048, device="cuda", generator=g) * 0.02).bfloat16().requires_grad_()
    t = torch.randint(0, 151936, (rows,), device="cuda", generator=g)
    up = torch.randn(rows, device="cuda", generator=g)
    got = token_logps(h, w, t, kernels=True)
    (got * up).sum().backward()
    hf, wf = h.detach().float().requires_grad_(), w.detach().float().requires_grad_()
    want = torch.log_softmax(hf @ wf.t(), -1).gather(1, t[:, None]).squeeze(1)
    (want * up).sum().backward()
    assert rel(got, want) < 1e-2 and rel(h.grad, hf.grad) < 2e-2 and rel(w.grad, wf.grad) < 2e-2
    with torch.no_grad():
        eager = token_logps(h, w, t)
    assert (got.detach() - eager).abs().max() < 1e-3


def test_a_fused_stack_matches_the_float32_padded_reference_and_builds_nothing_per_length():
    """Built ahead (as training does while it loads), the kernels serve micro-batches of every length without a
    single further build."""
    pairs = random_pairs(24, 151936, seed=0, max_prompt=300, max_comp=300)
    groups = split_micro_batches(pairs[:12], 2048, 0)
    torch.backends.cuda.matmul.allow_tf32 = False
    slow, g_slow = logps_and_grads(qwen3(torch.float32), [pad_pairs(g) for g in groups], Backend("padded"))
    model = qwen3(torch.bfloat16).train()
    kernels.build_ahead([1024, 128], torch.bfloat16, torch.device("cuda"), 128).join()
    builds = {k: built(getattr(kernels.jitted(), k)) for k in KERNELS}
    assert set(fuse_layers(model, use_kernels=True)) == {"Qwen3RMSNorm", "Qwen3MLP", "Qwen3Attention"}
    backend = choose_backend(model, "auto", True, torch.device("cuda"))
    prepare_packed(model, backend)
    fast, g_fast = logps_and_grads(model, [pack_pairs(g, 1) for g in groups], backend)
    assert rel(fast, slow) < 1e-2
    worst = max(rel(g_fast[n], g_slow[n]) for n in g_slow)
    assert worst < 5e-2, worst
    more = split_micro_batches(pairs[12:], 1536, 0)
    logps_and_grads(model, [pack_pairs(g, 1) for g in more], backend)
    with torch.no_grad():  # the reference's forward
        sequence_logps(model, pack_pairs(more[0], 1).to("cuda"), backend)
    lengths = {pack_pairs(g, 1).num_tokens for g in groups + more}
    assert len(lengths) >= 4 and {k: built(getattr(kernels.jitted(), k)) for k in KERNELS} == builds, lengths


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


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_a_lean_mlp_s_lora_down_on_cuda_keeps_no_product_and_is_as_close_to_float32_as_peft_s(dropout, monkeypatch):
    """The Triton MLP feeding a LoRA down projection (the product rebuilt in the backward, dropout's mask drawn in
    the kernels) through the varlen backend with full checkpointing, whose recompute skips the base GEMM: as close
    to the float32 model as PEFT's own forward on the plain layers; in training mode, the recompute replays the
    forward's masks."""
    from peft import LoraConfig, get_peft_model

    from fastdpo.model import lora
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
    apply = lora._SiluMulLoraDown.apply
    monkeypatch.setattr(lora._SiluMulLoraDown, "apply", lambda *a: calls.append((a[-2], a[-1])) or apply(*a))
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
