"""The dtype of the gradient sum across ranks (--reduce_dtype): on two ranks bfloat16 gradients summed in bfloat16
give the same bits as a float32 sum rounded back, so `auto` sums them in their own dtype there."""

from __future__ import annotations

import pytest
import torch
from dist_helpers import BASE, dataset, metrics, run_isolated, run_on_ranks, run_ranks, weights

from fastdpo.parallel.distributed import sums_in_fp32


def test_auto_widens_only_beyond_two_ranks():
    assert not sums_in_fp32("auto", 2)
    assert sums_in_fp32("auto", 3) and sums_in_fp32("auto", 8)
    assert sums_in_fp32("float32", 2)
    assert not sums_in_fp32("bfloat16", 8)


def test_a_bad_reduce_dtype_is_one_clean_message(capsys):
    from fastdpo.cli import main

    assert main(["train", "--model", "m", "--dataset", "d.jsonl", "--reduce_dtype", "half"]) == 1
    out = capsys.readouterr().out
    assert "--reduce_dtype 'half' is not one of: auto, float32, bfloat16" in out and "Traceback" not in out


@pytest.mark.parametrize(("dtype", "bits", "span"), [(torch.bfloat16, 8, 20), (torch.float16, 11, 10)])
def test_a_float32_sum_of_two_values_rounds_back_as_the_exact_sum_does(dtype, bits, span):
    """The arithmetic the rule rests on: a + b in float32, rounded to the gradients' dtype, is the exact sum rounded
    once to nearest-even in that dtype (what NCCL's sum in bfloat16 gives: tests/model/test_gpu.py). Magnitudes 2^±span
    keep the exact sum in float64 and out of subnormals; float32 itself rounds where the exponents differ by more
    than 24 - bits, so that case is covered."""
    import numpy as np

    g = torch.Generator().manual_seed(0)
    a, b = ((torch.randn(1 << 18, generator=g) * torch.exp2(torch.randint(-span, span, (1 << 18,), generator=g)))
            .to(dtype) for _ in range(2))
    exact = a.double().numpy() + b.double().numpy()  # exact: the bits span at most 2 * span + bits < 53
    mantissa, exponent = np.frexp(exact)
    once = np.ldexp(np.rint(mantissa * 2.0**bits), exponent - bits)  # np.rint: ties to even
    twice = (a.float() + b.float()).to(dtype).double().numpy()
    assert np.array_equal(once, twice)
    assert (np.abs(np.log2(np.abs(a.double().numpy()) / np.abs(b.double().numpy()))) > 24 - bits + 1).any()


@pytest.mark.parametrize("fsdp", ["", "shard_grad_op"])
def test_two_ranks_sum_bfloat16_gradients_to_the_same_bits(fsdp, tmp_path, model_dirs):
    """DDP and FSDP2 on two ranks, bfloat16 model: `auto` (sums in bfloat16, half the traffic) and `float32` end
    with bit-equal weights and equal metrics after six steps of two micro-steps."""
    common = dict(model=str(model_dirs("qwen3")), dataset=[str(dataset(tmp_path))], torch_dtype="bfloat16",
                  per_device_train_batch_size=2, gradient_accumulation_steps=2, fsdp=fsdp, **BASE)
    for dtype in ("auto", "float32"):
        run_ranks(2, output_dir=str(tmp_path / dtype), reduce_dtype=dtype, **common)
    narrow, wide = weights(tmp_path / "auto"), weights(tmp_path / "float32")
    assert narrow.keys() == wide.keys()
    for name, w in narrow.items():
        assert w.dtype == torch.bfloat16
        assert torch.equal(w, wide[name]), name
    for x, y in zip(metrics(tmp_path / "auto"), metrics(tmp_path / "float32"), strict=True):
        assert (x["loss"], x["grad_norm"]) == (y["loss"], y["grad_norm"]), x["step"]


@pytest.mark.parametrize("mode", ["ddp", "shard_grad_op"])
@pytest.mark.parametrize("wide", [True, False])
def test_the_collectives_run_in_the_chosen_dtype(mode, wide, model_dirs):
    """What the wrapped model hands to the collectives: float32 buffers when widening, else bfloat16 ones (FSDP2's
    reduce-scatter input, which its copy-in fills even on one rank)."""
    run_isolated(_collective_dtypes, mode, wide, str(model_dirs("qwen3")))


def _collective_dtypes(mode: str, wide: bool, model_dir: str) -> None:
    import torch.distributed as dist
    from data_helpers import random_pairs
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives as fsdp_comm
    from transformers import AutoModelForCausalLM

    from fastdpo.dpo.reference import Reference
    from fastdpo.model.backend import Backend, build_mask, make_batch, prepare_packed
    from fastdpo.parallel.distributed import Dist, parallel_plan
    from fastdpo.parallel.wrap import wrap_models

    seen = []  # a child process of its own: the wrappers below need no undoing
    for name in ("all_reduce", "reduce_scatter_tensor"):
        real = getattr(dist, name)
        setattr(dist, name, lambda t, *a, _real=real, **k: (seen.append(t.dtype), _real(t, *a, **k))[1])
    copy_in = fsdp_comm.foreach_reduce_scatter_copy_in
    fsdp_comm.foreach_reduce_scatter_copy_in = lambda grads, out, *a: (seen.append(out.dtype), copy_in(grads, out, *a))[1]
    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.bfloat16)
    backend = Backend("dense")
    prepare_packed(model, backend)
    plan = parallel_plan("" if mode == "ddp" else mode, "")
    d = Dist(0, 1, 0, plan.mode, plan.reshard_after_forward, sum_in_fp32=wide)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    policy = wrap_models(model, Reference("precompute"), backend, d)
    batch = make_batch(random_pairs(3, model.config.vocab_size, seed=0), backend, 0, torch.device("cpu"))
    sums, *_ = policy(batch, build_mask(batch, backend))
    sums.sum().backward()
    assert seen and set(seen) == {torch.float32 if wide else torch.bfloat16}, seen


def test_a_flagged_update_is_skipped_on_sharded_parameters():
    """FSDP2's DTensor parameters: the device flag skips fastdpo's AdamW and torch's fused AdamW (`found_inf`)
    alike, leaving the shards' bits, and a true flag updates them."""
    run_isolated(_flagged_update_on_shards)


def _flagged_update_on_shards() -> None:
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from fastdpo.optim.adamw import AdamW
    from fastdpo.optim.optimizer import step_unless_nonfinite, undo_step_count

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    for make in (lambda ps: AdamW(ps, lr=1e-2, seed=1), lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True)):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2)).bfloat16()
        fully_shard(model)
        opt = make(list(model.parameters()))
        model(torch.randn(4, 8, dtype=torch.bfloat16)).float().sum().backward()
        before = [p.full_tensor().clone() for p in model.parameters()]
        assert step_unless_nonfinite(opt, torch.tensor(False))
        undo_step_count(opt)
        assert all(torch.equal(a, p.full_tensor()) for a, p in zip(before, model.parameters()))
        assert all(float(s["step"]) == 0 for s in opt.state.values())
        assert step_unless_nonfinite(opt, torch.tensor(True))
        assert all(not torch.equal(a, p.full_tensor()) for a, p in zip(before, model.parameters()))
        assert all(float(s["step"]) == 1 for s in opt.state.values())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sharded_gradients_clip_as_the_whole_gradients_do(dtype):
    """FSDP2's gradients are clipped on their local shards with one all-reduce (`clip_grad_norm`): on two ranks,
    with uneven and empty shards, the norm and the clipped gradients equal torch's `clip_grad_norm_` over the whole
    unsharded gradients, for a clipping and a non-clipping max_norm and for none (inf); a NaN on one rank's shard
    makes the norm NaN on both."""
    run_on_ranks(2, _clip_on_shards, dtype)


def _clip_on_shards(rank: int, world: int, dtype: torch.dtype) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from fastdpo.parallel.collectives import _sharded_on_one_mesh, clip_grad_norm

    mesh = init_device_mesh("cpu", (world,))
    shapes = [(7, 3), (5,), (1,), (9, 4), (2, 2)]
    for max_norm in (0.5, 1e6, float("inf")):
        gen = torch.Generator().manual_seed(7)  # the same full tensors on every rank
        full = [torch.randn(s, generator=gen).to(dtype) for s in shapes]
        want = [torch.nn.Parameter(torch.zeros(s)) for s in shapes]
        for w, g in zip(want, full):
            w.grad = g.float().clone()
        want_norm = torch.nn.utils.clip_grad_norm_(want, max_norm)
        params = [torch.nn.Parameter(distribute_tensor(torch.zeros(s, dtype=dtype), mesh, [Shard(0)])) for s in shapes]
        for p, g in zip(params, full):
            p.grad = distribute_tensor(g.clone(), mesh, [Shard(0)])
        assert _sharded_on_one_mesh([p.grad for p in params])
        norm = clip_grad_norm(params, max_norm)
        assert not hasattr(norm, "full_tensor")
        torch.testing.assert_close(norm, want_norm, rtol=1e-6, atol=0)
        for p, w in zip(params, want):
            tol = dict(rtol=0, atol=0) if max_norm != 0.5 else dict(rtol=1e-2 if dtype == torch.bfloat16 else 1e-6,
                                                                    atol=1e-6)
            torch.testing.assert_close(p.grad.full_tensor().float(), w.grad.to(dtype).float(), **tol)
    params = [torch.nn.Parameter(distribute_tensor(torch.zeros(4, 2, dtype=dtype), mesh, [Shard(0)]))]
    grad = torch.ones(4, 2, dtype=dtype)
    grad[3, 1] = float("nan")  # on rank 1's shard
    params[0].grad = distribute_tensor(grad, mesh, [Shard(0)])
    assert torch.isnan(clip_grad_norm(params, 1.0))
