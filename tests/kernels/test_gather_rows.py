"""The gathered rows' backward (`fastdpo.kernels.gather_rows`), through the varlen attention's key gather, against
index_select's own backward in float32, under Triton's interpreter on the CPU (on CUDA: the fused varlen stack of
tests/kernels/test_warmup.py)."""

import pytest
import torch
from interpreter_helpers import interpreted, rel, run_interpreted


def test_gather_rows_under_the_interpreter():
    run_interpreted(__file__)


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gathered_keys_backward_sums_each_token_s_two_rows(dtype):
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
