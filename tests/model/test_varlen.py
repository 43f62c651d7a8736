"""The varlen attention backend against the plain computation, on the CPU.

The CUDA kernel (FlashAttention's variable-length kernel) does not run here, so two things are checked apart:
1. the sequence offsets (`varlen_layout`) allow exactly what the attention rule allows: the (query, key) pairs they
   admit are compared with `dense_mask`, the rule written elementwise, for random pairs and windows;
2. everything around the kernel (keys gathered per sequence, the offsets reaching every layer through transformers,
   the output back in packed order, GQA, gradients) through a float32 stand-in for the kernel: per-sequence causal
   SDPA aligned to the end, which is the kernel's contract. Completion log-probs and gradients of a tiny model
   equal those of the dense backend.
The kernel itself is checked against a float32 reference on the GPU (tests/model/test_gpu_varlen.py)."""

import pytest
import torch
from data_helpers import random_pairs
from model_helpers import admitted, varlen_stand_in

from fastdpo.data.pack import pack_pairs
from fastdpo.data.tokenize import TokenizedPair
from fastdpo.model import attention
from fastdpo.model.attention import dense_mask, varlen_layout

CASES = [
    [(3, 2, 4)],
    [(0, 3, 2), (4, 1, 1)],  # an unprompted pair: no prompt keys
    [(5, 4, 6), (2, 7, 3), (1, 1, 1)],
]


@pytest.mark.parametrize("window", [None, 1, 3])
@pytest.mark.parametrize("lens", CASES)
def test_offsets_admit_exactly_the_attention_rule(lens, window):
    pairs = [TokenizedPair(prompt=[5] * p, chosen=[6] * c, rejected=[7] * r, index=i) for i, (p, c, r) in enumerate(lens)]
    for pad in (1, 16):  # and with trailing filler, which attends only to itself
        batch = pack_pairs(pairs, pad)
        got = admitted(batch.pair_lengths, batch.num_tokens, window)
        want = dense_mask(batch, window)[0, 0]
        real = batch.pair_ids >= 0
        assert torch.equal(got[real][:, real], want[real][:, real])
        assert not got[real][:, ~real].any() and not got[~real][:, real].any()


def test_random_pairs_are_admitted_exactly():
    pairs = random_pairs(20, 50, seed=3, max_prompt=9, max_comp=7)
    batch = pack_pairs(pairs, 1)
    assert torch.equal(admitted(batch.pair_lengths, batch.num_tokens, None), dense_mask(batch)[0, 0])


def test_key_sources_name_each_token_s_places_among_the_keys():
    """Each packed token's first and second place in key_index, as the gathered keys' backward reads them: a
    prompt token twice (both sequences of its pair), every other token once, filler included."""
    from fastdpo.model.attention import key_sources

    lens = [(3, 2, 4), (0, 3, 2), (4, 1, 1), (2, 3, 0), (5, 4, 6)]
    total = sum(map(sum, lens)) + 3  # trailing filler
    key_index = varlen_layout(lens, total)[0]
    places: dict[int, list[int]] = {}
    for at, token in enumerate(key_index):
        places.setdefault(token, []).append(at)
    first, second = key_sources(lens, total)
    assert [places[t][0] for t in range(total)] == first
    assert [places[t][1] if len(places[t]) > 1 else -1 for t in range(total)] == second
    assert max(map(len, places.values())) == 2 and second.count(-1) == total - sum(p for p, _, r in lens if r)


def test_a_broken_layout_is_caught():
    """The comparison can fail: rejected queries over [prompt | chosen | rejected] keys differ from the rule."""
    batch = pack_pairs([TokenizedPair(prompt=[5] * 2, chosen=[6] * 2, rejected=[7] * 2, index=0)], 1)
    leaky = torch.tril(torch.ones(6, 6, dtype=torch.bool))  # one causal sequence: rejected sees chosen
    assert not torch.equal(leaky, dense_mask(batch)[0, 0])


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_varlen_path_equals_the_dense_path_in_float32(model_dirs, monkeypatch, family):
    from fastdpo.model.backend import Backend, prepare_packed, sequence_logps
    from fastdpo.model.load import load_model

    monkeypatch.setattr(attention, "_varlen_kernel", varlen_stand_in)
    model = load_model(str(model_dirs(family)), torch.float32, torch.device("cpu"))
    cfg = model.config
    assert cfg.num_attention_heads != cfg.num_key_value_heads  # GQA is exercised
    pairs = random_pairs(5, cfg.vocab_size, seed=1, max_prompt=8, max_comp=6)
    pairs.append(TokenizedPair(prompt=[], chosen=[9, 10], rejected=[11], index=5))  # unprompted
    results = {}
    for name in ("varlen", "dense"):
        backend = Backend(name)
        prepare_packed(model, backend)
        model.zero_grad()
        seq, tok = sequence_logps(model, pack_pairs(pairs, 1), backend)
        (seq * torch.linspace(0.5, 1.5, seq.numel())).sum().backward()
        results[name] = seq.detach(), tok.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}
    (s_v, t_v, g_v), (s_d, t_d, g_d) = results["varlen"], results["dense"]
    torch.testing.assert_close(s_v, s_d, rtol=0, atol=1e-5)
    torch.testing.assert_close(t_v, t_d, rtol=0, atol=1e-5)
    for n in g_d:  # float32 rounding of sums taken in another order (keys gathered per sequence): ~1e-7 relative
        assert (g_v[n] - g_d[n]).norm() <= 1e-5 * g_d[n].norm() + 1e-8, n


def test_the_varlen_call_takes_the_offsets_and_the_window(monkeypatch):
    """The wrapper hands the kernel fastdpo's window as (W - 1, 0) and causal as the tuple (-1, 0)."""
    seen = []

    def fake(q, k, v, cu_q, cu_k, max_q, max_k, **kw):
        seen.append(kw)
        return q

    monkeypatch.setattr(attention, "_VARLEN_API", (fake, frozenset({"window_size", "scale", "enable_gqa"})))
    q, k = torch.zeros(4, 4, 2), torch.zeros(4, 2, 2)
    attention._varlen_kernel(q, k, k, None, None, 4, 4, 0.5, None)
    attention._varlen_kernel(q, k, k, None, None, 4, 4, None, 64)
    assert seen == [{"window_size": (-1, 0), "scale": 0.5, "enable_gqa": True},
                    {"window_size": (63, 0), "enable_gqa": True}]


def test_the_direct_flash_function_passes_the_offsets_the_window_and_the_saved_state(monkeypatch):
    """`attention._Flash` against stand-ins for the aten ops: the forward's arguments, its output and log-sum-exp
    handed to the backward with the forward's rng state, and the grads returned in q, k, v's places."""
    calls = {}

    def forward(q, k, v, cu_q, cu_k, max_q, max_k, p, causal, debug, *, scale, window_size_left, window_size_right):
        calls["fwd"] = (max_q, max_k, p, causal, debug, scale, window_size_left, window_size_right)
        return varlen_stand_in(q, k, v, cu_q, cu_k, max_q, max_k, scale, None) * 2, q.new_full((3,), 7.0), "seed", "off", None

    def backward(grad, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, p, causal, seed, off, *, scale,
                 window_size_left, window_size_right):
        calls["bwd"] = (max_q, max_k, p, causal, seed, off, scale, window_size_left, window_size_right)
        calls["saved"] = (out.clone(), lse.clone())
        return grad + 1, torch.full_like(k, 2.0), torch.full_like(v, 3.0)

    monkeypatch.setattr(torch.ops.aten, "_flash_attention_forward", forward, raising=False)
    monkeypatch.setattr(torch.ops.aten, "_flash_attention_backward", backward, raising=False)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(6, 4, 8, generator=g, requires_grad=True)
    k = torch.randn(9, 2, 8, generator=g, requires_grad=True)
    v = torch.randn(9, 2, 8, generator=g, requires_grad=True)
    cu_q, cu_k = torch.tensor([0, 4, 6], dtype=torch.int32), torch.tensor([0, 4, 9], dtype=torch.int32)
    out = attention._Flash.apply(q, k, v, cu_q, cu_k, 8, 8, 0.25, 63)
    assert calls["fwd"] == (8, 8, 0.0, True, False, 0.25, 63, 0)
    torch.testing.assert_close(out, 2 * varlen_stand_in(q, k, v, cu_q, cu_k, 8, 8, 0.25, None))
    w = torch.randn(out.shape, generator=g)
    dq, dk, dv = torch.autograd.grad((out * w).sum(), (q, k, v))
    assert calls["bwd"] == (8, 8, 0.0, True, "seed", "off", 0.25, 63, 0)
    assert torch.equal(calls["saved"][0], out.detach()) and torch.equal(calls["saved"][1], torch.full((3,), 7.0))
    assert torch.equal(dq, w + 1) and torch.equal(dk, torch.full_like(k, 2.0)) and torch.equal(dv, torch.full_like(v, 3.0))


def test_auto_picks_dense_on_cpu_and_varlen_needs_cuda(model_dirs):
    from fastdpo.errors import FastDPOError
    from fastdpo.model.backend import choose_backend
    from fastdpo.model.load import load_model

    model = load_model(str(model_dirs("qwen3")), torch.float32, torch.device("cpu"))
    assert choose_backend(model, "auto", True, torch.device("cpu")).name == "dense"
    with pytest.raises(FastDPOError, match="varlen needs a CUDA device"):
        choose_backend(model, "varlen", True, torch.device("cpu"))


def test_length_bounds_are_few():
    from fastdpo.model.attention import length_bound

    assert [length_bound(n) for n in (1, 128, 129, 1000, 1024, 1025, 5000)] == [128, 128, 256, 1024, 1024, 2048, 8192]


def _window_of(window_size, is_causal):
    """The stand-in's window from the custom op's (left, right) window_size."""
    left = -1 if not window_size else window_size[0]
    return None if left < 0 else left + 1


@pytest.fixture
def varlen_on_cpu():
    """CPU kernels for torch's varlen custom ops (forward: the float32 stand-in; backward: autograd through it), so
    torch's own `varlen_attn`, its custom op and torch.compile around it run here as they run on CUDA."""
    varlen = pytest.importorskip("torch.nn.attention.varlen")

    def fwd(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, scale=None, window_size=None,
            enable_gqa=False, *rest, **kw):
        out = varlen_stand_in(query.float(), key.float(), value.float(), cu_seq_q, cu_seq_k, max_q, max_k, scale,
                       _window_of(window_size, is_causal)).to(query.dtype)
        return out, torch.zeros(query.shape[1], query.shape[0]), torch.zeros(2, dtype=torch.uint64)

    def bwd(grad_out, query, key, value, out, lse, cu_seq_q, cu_seq_k, max_q, max_k, is_causal, rng_state,
            scale=None, window_size=None, *rest, **kw):
        # kernels run below autograd, so the stand-in's backward is written out: softmax attention's gradients
        window = _window_of(window_size, is_causal)
        q, k, v, do = query.float(), key.float(), value.float(), grad_out.float()
        g = q.shape[1] // k.shape[1]
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        cq, ck = cu_seq_q.tolist(), cu_seq_k.tolist()
        for a, b, c, e in zip(cq, cq[1:], ck, ck[1:]):
            qs, dos = q[a:b].transpose(0, 1), do[a:b].transpose(0, 1)  # (H, Lq, D)
            ks = k[c:e].repeat_interleave(g, 1).transpose(0, 1)
            vs = v[c:e].repeat_interleave(g, 1).transpose(0, 1)
            i = torch.arange(b - a)[:, None] + (e - c) - (b - a)
            j = torch.arange(e - c)[None]
            allow = (j <= i) if window is None else (j <= i) & (i - j < window)
            prob = (qs @ ks.transpose(1, 2) * scale).masked_fill(~allow, float("-inf")).softmax(-1)
            dp = dos @ vs.transpose(1, 2)
            ds = prob * (dp - (dp * prob).sum(-1, keepdim=True)) * scale
            dq[a:b] = (ds @ ks).transpose(0, 1)
            dk[c:e] = (ds.transpose(1, 2) @ qs).transpose(0, 1).reshape(e - c, -1, g, q.shape[-1]).sum(2)
            dv[c:e] = (prob.transpose(1, 2) @ dos).transpose(0, 1).reshape(e - c, -1, g, q.shape[-1]).sum(2)
        return dq.to(query.dtype), dk.to(key.dtype), dv.to(value.dtype)

    ops = (varlen._varlen_attn, varlen._varlen_attn_backward)
    for op, kernel in zip(ops, (fwd, bwd)):
        op.register_kernel("cpu")(kernel)
    yield
    for op in ops:  # the CPU kernels go again: no other test sees them
        op._backend_fns.pop("cpu", None)


def test_compiled_layers_take_every_length_through_trainer_step(tmp_path, model_dirs, monkeypatch, varlen_on_cpu):
    """--torch_compile around varlen: one graph per layer function for every micro-batch length, through the real
    training step (parallelize -> compile_layers). Dynamo's guards are what is checked, so the eager backend (no
    code generation) is enough; the kernels are torch's varlen_attn with CPU stand-ins."""
    import functools

    import torch._dynamo

    from fastdpo.config import TrainConfig
    from fastdpo.model import backend as backend_mod
    from fastdpo.model.load import load_model, load_tokenizer
    from fastdpo.model.memory import compile_layers
    from fastdpo.parallel import parallelize
    from fastdpo.training import setup
    from fastdpo.training.trainer import Trainer

    monkeypatch.setattr(setup, "choose_backend", lambda *a, **k: backend_mod.Backend("varlen"))
    monkeypatch.setattr(parallelize, "compile_layers", functools.partial(compile_layers, backend="eager"))
    path = str(model_dirs("qwen3"))
    model = load_model(path, torch.bfloat16, torch.device("cpu"))
    pairs = random_pairs(20, model.config.vocab_size, seed=4, max_prompt=40, max_comp=30)
    cfg = TrainConfig(model=path, dataset=["x"], output_dir=str(tmp_path / "o"), torch_compile=True, max_steps=5,
                      per_device_train_batch_size=4, device="cpu", torch_dtype="bfloat16")
    torch._dynamo.reset()
    trainer = Trainer(cfg, setup.assemble(cfg, torch.device("cpu"), model, load_tokenizer(path), pairs))
    graphs = []
    for i in range(5):
        result = trainer.step(pairs[4 * i:4 * i + 4])
        assert result.finite
        graphs.append(torch._dynamo.utils.counters["stats"]["unique_graphs"])
    lengths = {sum(p.num_tokens for p in pairs[4 * i:4 * i + 4]) for i in range(5)}
    assert len(lengths) == 5  # five different micro-batch lengths
    assert graphs[-1] == graphs[0] > 0, graphs  # built once, at the first step


def test_the_packed_lists_become_the_tensors_torch_tensor_would_give():
    from fastdpo.data.pack import int_tensor

    for dtype, values in [(torch.long, [3, -1, 2**40, 0]), (torch.int32, [-1, 7, 2**31 - 1]), (torch.int8, [0, 1, 2, -1])]:
        got = int_tensor(values, dtype)
        assert got.dtype == dtype and torch.equal(got, torch.tensor(values, dtype=dtype))
    assert int_tensor([]).shape == (0,) and int_tensor([], torch.int8).dtype == torch.int8
    overflow = pytest.raises(OverflowError)
    with overflow:
        int_tensor([128], torch.int8)
