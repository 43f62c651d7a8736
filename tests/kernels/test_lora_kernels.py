"""The LoRA dropout kernels (`fastdpo.kernels.lora`): the dropped product x @ A^T and both gradients against float32
under the kernels' own mask, and the mask's statistics, under Triton's interpreter on the CPU and compiled for CUDA
at real widths. The lean LoRA forward that calls them is tested in tests/model/test_lora_fused.py."""

import pytest
import torch
from interpreter_helpers import interpreted, rel, run_interpreted

from fastdpo.kernels import lora


def test_lora_kernels_under_the_interpreter():
    run_interpreted(__file__)


def test_the_dropout_kernels_threshold_draws_p_to_the_nearest_sixteenth_bit():
    assert lora.lora_dropout_threshold(0.05) == 3277 and lora.lora_dropout_threshold(0.0) == 0
    assert lora.lora_dropout_threshold(1e-9) == 1  # a drop probability above 0 still drops
    for p in (0.01, 0.05, 0.1, 0.3, 0.5, 0.99):
        assert abs(lora.lora_dropout_threshold(p) / 2**16 - p) <= 2**-17


def lora_reference(x, a, gt, keep, p, scale):
    """The adapter's dropped product and its two gradients, in float32 from the same inputs and mask."""
    xd = x.float() * keep / (1 - p)
    return xd @ a.float().t(), (gt.float() @ a.float()) * keep * (scale / (1 - p)), gt.float().t() @ xd


@interpreted
@pytest.mark.parametrize("rows,width,rank", [(37, 200, 8), (70, 130, 16), (5, 64, 24), (0, 64, 8)])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_lora_dropout_kernels_equal_float32_under_their_own_mask(rows, width, rank, dtype, tol):
    g = torch.Generator().manual_seed(rows + width + rank)
    x = torch.randn(rows, width, generator=g).to(dtype)
    a = (0.1 * torch.randn(rank, width, generator=g)).to(dtype)
    gt = torch.randn(rows, rank, generator=g).to(dtype)
    p, seed = 0.3, 1234 + rows
    keep = lora.lora_dropout_keep(seed, (rows, width), p, x.device)
    t = lora.lora_dropout_down(x, a, seed, p)
    dx = lora.lora_dropout_input_grad(gt, a, seed, p, 2.0)
    da = lora.lora_dropout_weight_grad(gt, x, seed, p)
    want_t, want_dx, want_da = lora_reference(x, a, gt, keep, p, 2.0)
    assert t.dtype == dtype and dx.dtype == dtype and da.dtype == torch.float32
    assert t.shape == (rows, rank) and dx.shape == (rows, width) and da.shape == (rank, width)
    if rows:
        assert rel(t, want_t) < tol and rel(dx, want_dx) < tol and rel(da, want_da) < tol
        assert torch.equal(dx == 0, ~keep | (want_dx == 0))  # the backward drops where the forward dropped
    else:
        assert not da.any()


@interpreted
def test_lora_dropout_masks_keep_one_minus_p_and_follow_the_seed():
    shape = (300, 1000)
    for p in (0.05, 0.5):
        keep = lora.lora_dropout_keep(7, shape, p, torch.device("cpu"))
        assert abs(keep.float().mean().item() - (1 - p)) < 0.01
    a, b = (lora.lora_dropout_keep(s, shape, 0.5, torch.device("cpu")) for s in (7, 8))
    assert torch.equal(a, lora.lora_dropout_keep(7, shape, 0.5, torch.device("cpu"))) and not torch.equal(a, b)
    assert abs((a == b).float().mean().item() - 0.5) < 0.01  # another seed: an independent mask
    rows = a.view(300, 1000)
    assert not torch.equal(rows[0], rows[1])  # nor one mask repeated row after row
    # the two halves of a word, and neighbouring words, decide independently: neighbours agree half the time
    for step in (1, 2, 8):
        assert abs((rows[:, step:] == rows[:, :-step]).float().mean().item() - 0.5) < 0.01, step
    # the forward applies exactly that mask: through an identity adapter, dropout(x) itself comes out
    x = torch.rand(64, 16) + 1
    t = lora.lora_dropout_down(x, torch.eye(16), 9, 0.25)
    torch.testing.assert_close(t, x * lora.lora_dropout_keep(9, (64, 16), 0.25, x.device) / 0.75)


@pytest.mark.gpu
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
    keep = lora.lora_dropout_keep(seed, (rows, width), p, x.device)
    assert abs(keep.float().mean().item() - (1 - p)) < (0.01 if rows > 1 else 0.05)
    t = lora.lora_dropout_down(x, a, seed, p)
    dx = lora.lora_dropout_input_grad(gt, a, seed, p, 2.0)
    da = lora.lora_dropout_weight_grad(gt, x, seed, p)
    xd = x * keep * (1.0 / (1.0 - p))  # torch's rounding of the dropped input
    f64 = {"dtype": torch.float64}
    assert rel(t, xd.to(**f64) @ a.to(**f64).t()) < tol
    assert rel(dx, (gt.to(**f64) @ a.to(**f64)) * keep * (2.0 / (1 - p))) < tol
    assert rel(da, gt.to(**f64).t() @ xd.to(**f64)) < 1e-4  # float32 sums of the very products (TF32: ~1e-3)
    assert torch.equal(dx == 0, ~keep | (dx == 0))
