"""The chunked token log-probs through the head (`fastdpo.kernels.logprob_head`) against full float32 logits,
forward and backward: on torch's path, on the kernels under Triton's interpreter on the CPU, and compiled for CUDA
at Qwen3's vocabulary."""

import pytest
import torch
from interpreter_helpers import interpreted, rel, run_interpreted

from fastdpo.kernels import logprob_head
from fastdpo.kernels.logprob_head import token_logps


def test_logprob_head_under_the_interpreter():
    run_interpreted(__file__)


def naive(hidden, weight, targets, scale=1.0, softcap=None):
    logits = (hidden.double() @ weight.double().t()) * scale
    if softcap:
        logits = softcap * torch.tanh(logits / softcap)
    return torch.log_softmax(logits, -1).gather(1, targets[:, None]).squeeze(1)


@pytest.mark.parametrize("scale,softcap,chunk", [(1.0, None, 7), (0.5, None, 64), (1.0, 3.0, 5)])
def test_token_logps_match_full_logits(scale, softcap, chunk):
    g = torch.Generator().manual_seed(0)
    h = torch.randn(23, 16, generator=g, requires_grad=True)
    w = torch.randn(50, 16, generator=g, requires_grad=True)
    t = torch.randint(0, 50, (23,), generator=g)
    upstream = torch.randn(23, generator=g)
    fast = token_logps(h, w, t, chunk=chunk, scale=scale, softcap=softcap)
    (fast * upstream).sum().backward()
    gh, gw = h.grad.clone(), w.grad.clone()
    h.grad = w.grad = None
    ref = naive(h, w, t, scale, softcap)
    (ref * upstream.double()).sum().backward()
    torch.testing.assert_close(fast.double(), ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gh, h.grad, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(gw, w.grad, rtol=1e-4, atol=1e-5)


def test_frozen_head_gets_no_grad():
    h = torch.randn(5, 8, requires_grad=True)
    w = torch.randn(11, 8)
    token_logps(h, w, torch.randint(0, 11, (5,))).sum().backward()
    assert h.grad is not None and w.grad is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_head_gradient_over_chunks_and_no_rows(dtype):
    """The head's gradient is summed in float32 over the chunks (bf16 inputs too) and is zeros, not None, when no
    completion token is in the batch."""
    g = torch.Generator().manual_seed(1)
    h = torch.randn(40, 16, generator=g).to(dtype).requires_grad_()
    w = torch.randn(30, 16, generator=g).to(dtype).requires_grad_()
    t = torch.randint(0, 30, (40,), generator=g)
    token_logps(h, w, t, chunk=9).sum().backward()
    hd, wd = h.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    naive(hd, wd, t).sum().backward()
    assert w.grad.dtype == dtype
    err = ((w.grad.double() - wd.grad).norm() / wd.grad.norm()).item()
    assert err < (1e-2 if dtype == torch.bfloat16 else 1e-6), err  # bf16: its logits and weights are rounded
    h.grad = w.grad = None
    token_logps(h[:0], w, t[:0]).sum().backward()
    assert torch.equal(w.grad, torch.zeros_like(w)) and h.grad.shape == h.shape


def head_reference(h, w, t, scale):
    hf, wf = h.detach().float().requires_grad_(), w.detach().float().requires_grad_()
    return hf, wf, torch.log_softmax((hf @ wf.t()) * scale, -1).gather(1, t[:, None]).squeeze(1)


@interpreted
@pytest.mark.parametrize("rows,vocab,chunk", [(1, 100, 1024), (37, 5000, 16), (0, 300, 16)])
@pytest.mark.parametrize("dtype,scale,tol", [(torch.float32, 1.0, 1e-5), (torch.bfloat16, 0.5, 2e-2)])
def test_log_prob_head_kernels_equal_float32(monkeypatch, rows, vocab, chunk, dtype, scale, tol):
    """Target log-probs and both gradients through the kernels (a vocabulary over one block of the kernels and
    under it, chunks off the row count, no rows) against float32 autograd, and the kernels were what ran."""
    g = torch.Generator().manual_seed(rows + vocab)
    h = torch.randn(rows, 16, generator=g).mul(2).to(dtype).requires_grad_()
    w = torch.randn(vocab, 16, generator=g).to(dtype).requires_grad_()
    t = torch.randint(0, vocab, (rows,), generator=g)
    up = torch.randn(rows, generator=g)
    calls = []
    for name in ("logp_forward", "logp_backward_"):
        fn = getattr(logprob_head, name)
        monkeypatch.setattr(logprob_head, name, lambda *a, _fn=fn, _n=name: calls.append(_n) or _fn(*a))
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


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 2500])
def test_log_prob_head_kernels_equal_float32_at_a_real_vocabulary(rows):
    """Qwen3's 151,936-wide head: target log-probs and both gradients through the kernels against float32 autograd,
    and the log-probs against the eager bfloat16 path's."""
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
