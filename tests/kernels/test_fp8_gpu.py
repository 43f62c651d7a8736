"""The FP8 linear's `torch._scaled_mm` path against its float32 emulation, on a CUDA GPU with FP8 tensor cores
(compute capability 8.9+): `pytest -m gpu tests/kernels/test_fp8_gpu.py`. Both read the same e4m3 values and
scales, so they differ only in the order of float32 sums and in the bfloat16 rounding of the output."""

import pytest
import torch

from fastdpo.kernels.fp8 import Fp8LinearFunction, quantise_rowwise, scaled_mm_serves

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
    reason="needs a CUDA GPU with FP8 tensor cores (compute capability 8.9+)")]


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("m,k,n", [(8192, 2048, 4096), (1000, 2048, 6144), (37, 64, 48), (1, 16, 32)])
def test_scaled_mm_matches_the_emulation_forward_and_backward(m, k, n):
    """Token counts that are not multiples of 16 too (1000, 37, 1): `_scaled_mm` needs only the widths to be."""
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(m, k, device="cuda", generator=g).bfloat16()
    w = torch.randn(n, k, device="cuda", generator=g) / k**0.5
    wq, w_scale = quantise_rowwise(w.bfloat16())
    up = torch.randn(m, n, device="cuda", generator=g).bfloat16()
    assert scaled_mm_serves(wq, wq, torch.bfloat16)
    outs = {}
    for emulate in (False, True):
        xr = x.clone().requires_grad_()
        y = Fp8LinearFunction.apply(xr, wq, w_scale, None, emulate)
        (gx,) = torch.autograd.grad(y, xr, up)
        assert y.dtype == gx.dtype == torch.bfloat16
        outs[emulate] = (y, gx)
    (y, gx), (ey, egx) = outs[False], outs[True]
    # the same FP8 operands: within bfloat16 rounding of each other (2**-8 relative), not FP8's few percent
    assert rel(y, ey) < 4e-3 and rel(gx, egx) < 4e-3
    # and both within FP8's bound of the bfloat16 product
    assert rel(y, x.float() @ w.t()) < 0.06 and rel(gx, up.float() @ w) < 0.06


def test_widths_not_multiples_of_16_fall_back_to_the_emulation_on_the_gpu():
    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(5, 24, device="cuda", generator=g).bfloat16().requires_grad_()
    wq, w_scale = quantise_rowwise(torch.randn(40, 24, device="cuda", generator=g))
    assert not scaled_mm_serves(wq, wq, torch.bfloat16)
    y = Fp8LinearFunction.apply(x, wq, w_scale, None)
    (gx,) = torch.autograd.grad(y.float().sum(), x)
    ey = Fp8LinearFunction.apply(x.detach(), wq, w_scale, None, True)
    assert torch.equal(y, ey) and gx.shape == x.shape and torch.isfinite(gx).all()


@pytest.mark.parametrize("recipe", ["rowwise", "tensorwise"])
@pytest.mark.parametrize("m,k,n", [(8192, 2048, 6144), (1000, 2048, 2048), (37, 64, 48)])
def test_the_trained_fp8_linear_on_scaled_mm_matches_its_emulation(recipe, m, k, n):
    """--fp8's linear: output, x's gradient and the weight's gradient, `_scaled_mm` against the float32 emulation
    of the same quantised operands, both scaling recipes."""
    from fastdpo.kernels.fp8 import Fp8TrainLinearFunction, quantise

    g = torch.Generator(device="cuda").manual_seed(2)
    x = torch.randn(m, k, device="cuda", generator=g).bfloat16()
    w = (torch.randn(n, k, device="cuda", generator=g) / k**0.5).bfloat16()
    up = torch.randn(m, n, device="cuda", generator=g).bfloat16()
    wq, w_scale = quantise(w, recipe)
    assert scaled_mm_serves(wq, wq, torch.bfloat16)
    outs = {}
    for emulate in (False, True):
        xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = Fp8TrainLinearFunction.apply(xr, wr, None, wq, w_scale, recipe, None, None, emulate)
        outs[emulate] = (y, *torch.autograd.grad(y, (xr, wr), up))
    for got, want in zip(outs[False], outs[True]):
        assert got.dtype == torch.bfloat16 and rel(got, want) < 4e-3
    y, gx, gw = outs[False]
    assert rel(y, x.float() @ w.float().t()) < 0.06 and rel(gx, up.float() @ w.float()) < 0.06
    assert rel(gw, up.float().t() @ x.float()) < 4e-3  # the weight's gradient: a bfloat16 product, unquantised


@pytest.mark.parametrize("recipe", ["rowwise", "tensorwise"])
def test_a_full_fine_tune_with_fp8_trains_and_its_certificate_passes(tmp_path, model_dirs, recipe):
    import json

    from data_helpers import easy_rows, write_jsonl

    from fastdpo.config import TrainConfig
    from fastdpo.training.loop import train

    data = write_jsonl(tmp_path / "d.jsonl", easy_rows(32))
    cfg = TrainConfig(model=str(model_dirs("qwen3", hidden=128)), dataset=[str(data)], fp8=True, fp8_recipe=recipe,
                      learning_rate=1e-4, max_steps=8, per_device_train_batch_size=8, device="cuda",
                      output_dir=str(tmp_path / "o"), torch_dtype="bfloat16", disable_progress=True)
    train(cfg, progress=False)
    rows = [json.loads(line) for line in open(tmp_path / "o" / "metrics.jsonl")]
    summary = json.loads((tmp_path / "o" / "summary.json").read_text())
    assert summary["certificate"]["status"] == "PASS"
    assert all(r["loss"] == r["loss"] for r in rows)  # finite
    assert rows[-1]["rewards/margins"] > rows[0]["rewards/margins"]


def test_lora_on_the_fp8_base_trains_on_cuda_with_the_kernels_and_its_certificate_passes(tmp_path, model_dirs):
    """--fp8_base end to end where the kernels serve: fusing probes the layers in the activations' dtype, the base's
    products run on `_scaled_mm`, the adapters train and the certificate passes."""
    import json

    from data_helpers import easy_rows, write_jsonl

    from fastdpo.config import TrainConfig
    from fastdpo.training.loop import train

    data = write_jsonl(tmp_path / "d.jsonl", easy_rows(32))
    cfg = TrainConfig(model=str(model_dirs("qwen3", hidden=128)), dataset=[str(data)], train_type="lora",
                      fp8_base=True, lora_rank=8, learning_rate=5e-3, max_steps=8, per_device_train_batch_size=8,
                      device="cuda", output_dir=str(tmp_path / "o"), torch_dtype="bfloat16", disable_progress=True)
    train(cfg, progress=False)
    rows = [json.loads(line) for line in open(tmp_path / "o" / "metrics.jsonl")]
    summary = json.loads((tmp_path / "o" / "summary.json").read_text())
    assert summary["certificate"]["status"] == "PASS"
    assert rows[-1]["rewards/margins"] > rows[0]["rewards/margins"]



@pytest.mark.parametrize("rows,width,columns", [(3001, 2048, False), (8192, 6144, True), (1, 16, True)])
def test_the_quantising_kernel_on_cuda_is_the_exact_quantisation(rows, width, columns):
    """On CUDA `quantise_rowwise` runs its Triton kernel: each row's scale correctly rounded (amax / 448) and each
    value the IEEE quotient on e4m3's grid, bit for bit what eager torch's `_quantise` gives (with the weight's
    scales on the columns too, as an input gradient's quantisation takes them); a float32 division by 448 on CUDA
    gave one ulp less on about half the rows."""
    from fp8_helpers import exact_rowwise

    from fastdpo.kernels.fp8 import E4M3, _quantise

    g = torch.Generator(device="cuda").manual_seed(rows)
    x = torch.randn(rows, width, device="cuda", generator=g).mul(3).bfloat16()
    col = torch.rand(1, width, device="cuda", generator=g).add(0.5) if columns else None
    q, scale = quantise_rowwise(x, col_scale=col)
    want_q, want_scale = _quantise(x, col, E4M3)
    assert torch.equal(scale, want_scale) and torch.equal(q.float(), want_q.float())
    if not columns:
        exact_q, exact_scale = exact_rowwise(x)
        assert torch.equal(scale, exact_scale) and torch.equal(q.float(), exact_q.float())
