"""The chunked completion log-probs against full float32 logits, forward and backward."""

import pytest
import torch

from fastdpo.model.logprobs import sequence_sums, token_logps


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


def test_sequence_sums():
    v = torch.tensor([1.0, 2.0, 3.0, 4.0])
    assert sequence_sums(v, torch.tensor([0, 2, 0, 1]), 3).tolist() == [4.0, 4.0, 2.0]
