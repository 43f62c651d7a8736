"""GPU parity of the fast paths against the padded path (bf16). Run on a CUDA device: `pytest -m gpu tests/model/test_gpu.py`."""

import math

import pytest
import torch
from data_helpers import random_pairs
from gpu_helpers import logps_and_grads, rel
from gpu_helpers import qwen3 as qwen3_model

from fastdpo.data.pack import pack_pairs, pad_pairs, split_micro_batches
from fastdpo.model.backend import Backend, prepare_packed, sequence_logps
from fastdpo.model.memory import compile_layers

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("compiled", [False, True])
def test_flex_matches_padded_bf16(compiled):
    model = qwen3_model(torch.bfloat16)
    model.train()
    pairs = random_pairs(12, 151936, seed=0, max_prompt=300, max_comp=300)
    groups = split_micro_batches(pairs, 2048, 0)
    prepare_packed(model, Backend("flex"))
    if compiled:
        compile_layers(model)
    fast, g_fast = logps_and_grads(model, [pack_pairs(g, 128) for g in groups], Backend("flex"))
    slow, g_slow = logps_and_grads(model, [pad_pairs(g) for g in groups], Backend("padded"))
    # bf16 tolerances: per-sequence log-prob sums within 1e-2 relative; gradient groups within 5e-2 relative norm
    assert rel(fast, slow) < 1e-2
    worst = max(rel(g_fast[n], g_slow[n]) for n in g_slow)
    assert worst < 5e-2, worst


def test_flex_matches_fp32_reference():
    """fp32: the flex path against the padded path to float32 rounding (TF32 off)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    model = qwen3_model(torch.float32, layers=2).eval()
    pairs = random_pairs(6, 151936, seed=1, max_prompt=200, max_comp=200)
    prepare_packed(model, Backend("flex"))
    with torch.no_grad():
        fast = torch.cat([sequence_logps(model, pack_pairs(g, 128).to("cuda"), Backend("flex"))[0]
                          for g in split_micro_batches(pairs, 1024, 0)])
        slow = torch.cat([sequence_logps(model, pad_pairs(g).to("cuda"), Backend("padded"))[0]
                          for g in split_micro_batches(pairs, 1024, 0)])
    assert rel(fast, slow) < 1e-5


def test_flex_prompt_targets_match_fp32_padded():
    """ORPO's prompt targets on the flex path (rows padded to the flex block) against the padded path, float32."""
    from fastdpo.model.seqlogps import completion_logps

    torch.backends.cuda.matmul.allow_tf32 = False
    model = qwen3_model(torch.float32, layers=2).eval()
    pairs = random_pairs(6, 151936, seed=2, max_prompt=200, max_comp=100)
    prepare_packed(model, Backend("flex"))
    fast, slow = [], []
    with torch.no_grad():
        for g in split_micro_batches(pairs, 1024, 0):
            fast.append(completion_logps(model, pack_pairs(g, 128, prompt_targets=True).to("cuda"), Backend("flex")))
            slow.append(completion_logps(model, pad_pairs(g, prompt_targets=True).to("cuda"), Backend("padded")))
    for name in ("prompt", "sums"):
        assert rel(torch.cat([getattr(o, name) for o in fast]), torch.cat([getattr(o, name) for o in slow])) < 1e-5


def test_flex_kernel_stays_compiled_across_many_lengths():
    """Without --torch_compile the flex kernel is compiled on its own, one graph per micro-batch length. Past Dynamo's
    default limit of 8 it would run uncompiled (the whole score matrix); every length must keep its compiled graph."""
    import torch._dynamo

    name = "recompile_limit" if hasattr(torch._dynamo.config, "recompile_limit") else "cache_size_limit"
    with torch._dynamo.config.patch({name: 8}):  # Dynamo's default, restored on exit
        _many_flex_lengths()


def _many_flex_lengths():
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list
    from torch.nn.attention.flex_attention import flex_attention

    from fastdpo.model import attention

    torch._dynamo.reset()
    attention._compiled_flex.cache_clear()
    model = qwen3_model(torch.bfloat16, layers=1).eval()
    prepare_packed(model, Backend("flex"))
    pairs = random_pairs(16, 151936, seed=3, max_prompt=100, max_comp=60)
    lengths = set()
    with torch.no_grad():
        for i in range(1, 17):  # no budget: each micro-batch padded to the next multiple of 128 tokens
            batch = pack_pairs(pairs[:i], 128)
            lengths.add(batch.input_ids.shape[-1])
            fast, _ = sequence_logps(model, batch.to("cuda"), Backend("flex"))
            slow, _ = sequence_logps(model, pad_pairs(pairs[:i]).to("cuda"), Backend("padded"))
            assert rel(fast, slow) < 1e-2
    assert len(lengths) > 8
    assert len(_debug_get_cache_entry_list(flex_attention.__code__)) >= len(lengths)
    attention._compiled_flex.cache_clear()


def test_qlora_trains_on_cuda(tmp_path, model_dirs):
    pytest.importorskip("bitsandbytes")
    import json

    from data_helpers import easy_rows, write_jsonl

    from fastdpo.config import TrainConfig
    from fastdpo.training.loop import train

    data = write_jsonl(tmp_path / "d.jsonl", easy_rows(32))
    cfg = TrainConfig(model=str(model_dirs("qwen3", hidden=128)), dataset=[str(data)], train_type="qlora",
                      quant_bits=4, lora_rank=8, learning_rate=5e-3, max_steps=8, per_device_train_batch_size=8,
                      output_dir=str(tmp_path / "o"), torch_dtype="bfloat16", max_tokens_per_batch=512)
    train(cfg, progress=False)
    rows = [json.loads(line) for line in open(tmp_path / "o" / "metrics.jsonl")]
    assert all(r["loss"] == r["loss"] for r in rows)  # finite
    assert rows[-1]["rewards/margins"] > rows[0]["rewards/margins"]


def test_activation_offloading_keeps_gradients_and_lowers_peak():
    from fastdpo.model.memory import OffloadActivations

    model = qwen3_model(torch.bfloat16)
    model.train()
    prepare_packed(model, Backend("flex"))
    pairs = random_pairs(12, 151936, seed=2, max_prompt=300, max_comp=300)
    batches = [pack_pairs(g, 128) for g in split_micro_batches(pairs, 4096, 0)]
    logps_and_grads(model, batches, Backend("flex"))  # warm-up: kernels built, allocator settled

    def measured(ctx):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        with ctx:
            out = logps_and_grads(model, batches, Backend("flex"))
        torch.cuda.synchronize()
        return out, torch.cuda.max_memory_allocated() - base

    import contextlib

    (plain, g_plain), peak_plain = measured(contextlib.nullcontext())
    hooks = OffloadActivations(model)
    (off, g_off), peak_off = measured(hooks)
    assert hooks.offloaded_bytes > 0
    assert rel(off, plain) < 1e-3
    assert max(rel(g_off[n], g_plain[n]) for n in g_plain) < 1e-2
    assert peak_off < 0.8 * peak_plain, (peak_off, peak_plain)


def test_block_mask_matches_create_block_mask_on_cuda():
    from torch.nn.attention.flex_attention import create_block_mask

    from fastdpo.model.attention import FLEX_BLOCK, allowed, flex_block_mask

    pairs = random_pairs(40, 151936, seed=3, max_prompt=400, max_comp=300)
    batch = pack_pairs(pairs, 4096).to("cuda")
    pid, seg, pos = batch.pair_ids, batch.segments, batch.position_ids[0]

    def mask_mod(b, h, q, k):
        return allowed(pid[q], pid[k], seg[q], seg[k], q, k, pos[q], pos[k], None)

    t = pid.numel()
    theirs = create_block_mask(mask_mod, None, None, t, t, device="cuda", BLOCK_SIZE=FLEX_BLOCK)
    ours = flex_block_mask(batch)
    for name in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices", "q_num_blocks", "q_indices"):
        assert torch.equal(getattr(ours, name), getattr(theirs, name)), name


def _bf16_spacing(x: torch.Tensor) -> torch.Tensor:
    """Distance to the next bfloat16 value above |x| (float32)."""
    a = x.abs().float().bfloat16()
    up = (a.view(torch.int16) + 1).view(torch.bfloat16)
    return (up.float() - a.float()).clamp_min(1e-38)


def test_fused_adamw_kernel_matches_the_float32_update():
    from fastdpo.optim.adamw import AdamW

    torch.manual_seed(0)
    n = 3 * 2048 + 17  # a partial last block
    shapes = {"w": (n,), "norm": (64,)}
    init = {k: (torch.randn(s) * 0.02).bfloat16() for k, s in shapes.items()}
    grads = {k: (torch.randn(s) * 1e-2).bfloat16() for k, s in shapes.items()}
    results = {}
    for device in ("cpu", "cuda"):  # cpu: the foreach path; cuda: the Triton kernel
        params = [torch.nn.Parameter(init[k].clone().to(device)) for k in shapes]
        opt = AdamW(params, lr=1e-4, weight_decay=0.1, seed=5)
        calls = []
        if device == "cuda":
            fused = opt._fused_update()
            assert fused is not None, "Triton kernel not found on a CUDA machine"
            opt._fused = lambda *a, _c=calls, _f=fused, **k: (_c.append(1), _f(*a, **k))
        for _ in range(3):
            for p, k in zip(params, shapes):
                p.grad = grads[k].to(device).clone()
            opt.step()
        assert len(calls) == (3 if device == "cuda" else 0)  # one launch per step for both tensors
        results[device] = ([p.detach().cpu() for p in params],
                           [opt.state[p]["exp_avg"].cpu() for p in params],
                           [opt.state[p]["exp_avg_sq"].cpu() for p in params])
    for i in range(len(shapes)):
        w_cpu, w_gpu = results["cpu"][0][i].float(), results["cuda"][0][i].float()
        # both round the same float32 update up or down at random: at most one bfloat16 spacing per step apart
        # (spacing taken at the largest magnitude the weight had: a weight that crossed zero has a tiny spacing now)
        start = init[list(shapes)[i]].float()
        widest = torch.maximum(torch.maximum(w_cpu.abs(), w_gpu.abs()), start.abs())
        assert ((w_cpu - w_gpu).abs() <= 3 * _bf16_spacing(widest)).all()
        assert (w_cpu != init[list(shapes)[i]].float()).float().mean() > 0.5  # the weights moved
        for j in (1, 2):  # moments: the same float32 arithmetic, stored in bfloat16
            a, b = results["cpu"][j][i].float(), results["cuda"][j][i].float()
            assert ((a - b).abs() <= 2 * _bf16_spacing(a)).all()


def test_fused_adamw_rounding_is_unbiased():
    from fastdpo.kernels.adamw import adamw_update_

    # weight 1.0 (bfloat16 spacing 2^-7 above it): an update of +0.3 spacing must round up 30 % of the time
    n = 1 << 20
    w = torch.ones(n, device="cuda", dtype=torch.bfloat16)
    g = torch.full((n,), -1.0, device="cuda", dtype=torch.bfloat16)
    m, v = torch.zeros_like(w), torch.zeros_like(w)
    step_size = 0.3 * 2**-7  # adam's first step moves by lr (m/sqrt(v) = 1 after bias correction)
    ok = torch.ones(1, dtype=torch.bool, device="cuda")
    adamw_update_([w], [g], [m], [v], ok, lr=step_size, weight_decay=0.0, b1=0.9, b2=0.999, step=1, eps=0.0,
                  seeds=[123], stochastic=True)
    up = (w.float() > 1.0).float().mean().item()
    assert abs(up - 0.3) < 0.005
    assert set(w.float().unique().tolist()) == {1.0, 1.0 + 2**-7}
    near = torch.ones_like(w)
    adamw_update_([near], [g], [torch.zeros_like(w)], [torch.zeros_like(w)], ok, lr=step_size, weight_decay=0.0,
                  b1=0.9, b2=0.999, step=1, eps=0.0, seeds=[123], stochastic=False)
    assert (near.float() == 1.0).all()  # round to nearest drops the 0.3-spacing update


def test_fused_adamw_one_launch_updates_each_tensor_as_its_own_launch_would():
    """The table and program map of the one launch: tensors of many sizes (empty, a partial chunk, several chunks,
    smaller than one block) updated together get the bits that one launch per tensor gives them, stochastic rounding
    noise included; float32 weights too."""
    from fastdpo.kernels.adamw import BLOCK, ITERS, adamw_update_

    torch.manual_seed(0)
    sizes = [3 * BLOCK * ITERS + 17, 0, 64, BLOCK * ITERS, BLOCK + 1, 5]
    ok = torch.ones(1, dtype=torch.bool, device="cuda")
    for dtype, stochastic in ((torch.bfloat16, True), (torch.float32, False)):
        lists = [[(torch.randn(n, device="cuda") * s).to(dtype) for n in sizes] for s in (0.02, 1e-2, 1e-3, 1e-5)]
        lists[3] = [t.abs() for t in lists[3]]
        if dtype == torch.float32:  # tensors starting off 16-byte boundaries: the launch without alignment hints
            lists = [[torch.cat([t.new_zeros(1), t])[1:] for t in lst] for lst in lists]
        apart = [[t.clone() for t in lst] for lst in lists]
        seeds = [1000 + 37 * k for k in range(len(sizes))]
        kw = dict(lr=1e-3, weight_decay=0.1, b1=0.9, b2=0.999, step=4, eps=1e-8, stochastic=stochastic)
        before = [t.clone() for t in lists[0]]
        adamw_update_(*lists, ok, seeds=seeds, **kw)
        for k in range(len(sizes)):
            adamw_update_(*[[lst[k]] for lst in apart], ok, seeds=[seeds[k]], **kw)
        for together, alone in zip(lists, apart):
            for a, b in zip(together, alone):
                assert torch.equal(a, b)
        moved = [(w != b).float().mean() for w, b in zip(lists[0], before) if w.numel() >= 64]
        assert min(moved) > 0.5  # every tensor's update ran (about 70 % of bf16 weights change at this rate)


def test_fused_adamw_kernel_obeys_the_device_flag():
    """A false flag (computed on the GPU, never read by the host): weights and moments keep their bits; on the
    optimizer level a skipped NaN step changes nothing, for fastdpo's kernel and torch's fused AdamW."""
    from optim_helpers import check_skipped_step

    from fastdpo.kernels.adamw import adamw_update_

    w = torch.randn(5000, device="cuda").bfloat16()
    m, v = torch.randn_like(w) * 1e-3, torch.rand_like(w) * 1e-6
    g = torch.full_like(w, float("nan"))
    before = [t.clone() for t in (w, m, v)]
    adamw_update_([w], [g], [m], [v], torch.isfinite(g).all().reshape(1), lr=1e-3, weight_decay=0.1, b1=0.9,
                  b2=0.999, step=3, eps=1e-8, seeds=[7], stochastic=True)
    for a, b in zip(before, (w, m, v)):
        assert torch.equal(a, b)
    for kind in ("fastdpo", "torch_fused"):
        for dtype in (torch.bfloat16, torch.float32):
            check_skipped_step(kind, dtype, "cuda")


def test_profile_memory_reports_the_peak_on_cuda(tmp_path, model_dirs):
    """--profile_memory on a GPU: memory.txt's peak agrees with the allocator's own peak over the window, and the
    snapshot for memory_viz is written."""
    from data_helpers import easy_rows, write_jsonl

    from fastdpo.config import TrainConfig
    from fastdpo.training.loop import train

    data = write_jsonl(tmp_path / "d.jsonl", easy_rows(16, seed=1))
    cfg = TrainConfig(model=str(model_dirs("qwen3")), dataset=[str(data)], output_dir=str(tmp_path / "run"),
                      max_steps=3, profile_steps="2-3", profile_memory=True, disable_progress=True, device="cuda")
    torch.cuda.reset_peak_memory_stats()
    train(cfg, progress=False)
    prof = tmp_path / "run/profile/rank0"
    text = (prof / "memory.txt").read_text()
    assert (prof / "memory_snapshot.pickle").stat().st_size > 0
    peak = float(text.split("Peak in the window: ")[1].split(" GiB")[0])
    assert 0 < peak <= torch.cuda.max_memory_allocated() / 2**30 + 0.01
    assert "allocations" in text


def test_training_without_a_budget_builds_few_flex_lengths(tmp_path, model_dirs):
    """Default flags on CUDA (no --max_tokens_per_batch, no --torch_compile) with pairs of many lengths: training gets
    a budget, so its micro-batches take at most --length_buckets lengths (plus longer pairs'), the flex kernel stays
    compiled for each, and the loss is finite."""
    import json
    import random

    import torch._dynamo
    from data_helpers import write_jsonl
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list
    from torch.nn.attention.flex_attention import flex_attention

    from fastdpo.config import TrainConfig
    from fastdpo.model import attention
    from fastdpo.training.loop import train

    r = random.Random(5)
    rows = [{"prompt": " ".join(f"w{r.randrange(10, 60)}" for _ in range(r.randint(20, 900))),
             "chosen": " w5 w6" * r.randint(1, 60), "rejected": " w7 w8 w9" * r.randint(1, 40)} for _ in range(96)]
    data = write_jsonl(tmp_path / "d.jsonl", rows)
    torch._dynamo.reset()
    attention._compiled_flex.cache_clear()
    cfg = TrainConfig(model=str(model_dirs("qwen3")), dataset=[str(data)], output_dir=str(tmp_path / "run"),
                      max_steps=6, per_device_train_batch_size=4, gradient_accumulation_steps=4, max_length=4096,
                      disable_progress=True, device="cuda", save_steps=0, attn_impl="flex")
    train(cfg, progress=False)
    from fastdpo.config import RunPlan

    assert RunPlan.load(tmp_path / "run").max_tokens_per_batch > 0
    graphs = len(_debug_get_cache_entry_list(flex_attention.__code__))
    assert 0 < graphs <= 2 * (cfg.length_buckets + 4), graphs  # with and without grad; a few past the budget
    limit = getattr(torch._dynamo.config, "recompile_limit", None) or torch._dynamo.config.cache_size_limit
    assert graphs < limit  # no length ran uncompiled
    steps = [json.loads(line) for line in open(tmp_path / "run/metrics.jsonl")]
    assert len(steps) == 6 and all(math.isfinite(s["loss"]) for s in steps)


def test_policy_forward_and_backward_never_wait_for_the_device():
    """The host must be able to run ahead of the GPU through a whole micro-batch (forward, per-sequence sums, and
    backward): any op that reads a device value back (bincount, .item(), boolean indexing) stalls the queue and, under
    FSDP2, its prefetching. The first pass builds the kernels; the second runs with syncs made errors."""
    from fastdpo.model.backend import build_mask, make_batch
    from fastdpo.model.seqlogps import completion_logps

    model = qwen3_model(torch.bfloat16, layers=2)
    backend = Backend("flex")
    prepare_packed(model, backend)
    batch = make_batch(random_pairs(6, 1000), backend, 0, torch.device("cuda"), 1024)
    mask = build_mask(batch, backend)
    for mode in ("default", "error"):
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode(mode)
        try:
            out = completion_logps(model, batch, backend, mask)
            (out.sums.sum() + out.shared.sum()).backward()
        finally:
            torch.cuda.set_sync_debug_mode("default")


def test_head_gradient_accumulates_in_float32_inside_the_gemm(monkeypatch):
    """The chunked log-prob backward adds each chunk's head gradient into the float32 sum inside the GEMM (bf16
    inputs, float32 output): closer to the float64 gradient than forming each chunk's product in bf16 and adding it,
    the path it replaced (kept for other devices); the hidden-state gradient is unchanged."""
    import fastdpo.kernels.logprob_head as lp

    assert lp.has_out_dtype()
    g = torch.Generator(device="cuda").manual_seed(0)
    h = torch.randn(2500, 256, device="cuda", generator=g).bfloat16().requires_grad_()
    w = (torch.randn(4096, 256, device="cuda", generator=g) / 16).bfloat16().requires_grad_()
    t = torch.randint(0, 4096, (2500,), device="cuda", generator=g)
    up = torch.randn(2500, device="cuda", generator=g)

    def grads():
        h.grad = w.grad = None
        (lp.token_logps(h, w, t, chunk=512) * up).sum().backward()
        return h.grad.clone(), w.grad.clone()

    h_new, w_new = grads()
    monkeypatch.setattr(lp, "has_out_dtype", lambda: False)
    h_old, w_old = grads()
    hd, wd = h.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    logits = hd @ wd.t()
    (torch.log_softmax(logits, -1).gather(1, t[:, None]).squeeze(1) * up.double()).sum().backward()
    err_new, err_old = ((w_new.double() - wd.grad).abs().mean().item(), (w_old.double() - wd.grad).abs().mean().item())
    assert w_new.dtype == torch.bfloat16 and rel(w_new, wd.grad) < 1e-2
    assert err_new < err_old, (err_new, err_old)
    assert torch.equal(h_new, h_old)


_NCCL_SUMS = """
import torch, torch.distributed as dist
dist.init_process_group("nccl")
rank = dist.get_rank()
torch.cuda.set_device(rank)
g = torch.Generator(device="cuda").manual_seed(rank)
n = 1 << 26
x = (torch.randn(n, device="cuda", generator=g)
     * torch.exp2(torch.randint(-60, 60, (n,), device="cuda", generator=g))).bfloat16()
narrow, wide = x.clone(), x.float()
dist.all_reduce(narrow)
dist.all_reduce(wide)
assert torch.equal(narrow.view(torch.int16), wide.bfloat16().view(torch.int16)), "all_reduce"
out_n, out_w = torch.empty(n // 2, device="cuda", dtype=torch.bfloat16), torch.empty(n // 2, device="cuda")
dist.reduce_scatter_tensor(out_n, x)
dist.reduce_scatter_tensor(out_w, x.float())
assert torch.equal(out_n.view(torch.int16), out_w.bfloat16().view(torch.int16)), "reduce_scatter"
dist.destroy_process_group()
"""


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_nccl_bfloat16_sum_of_two_ranks_equals_the_float32_sum(tmp_path):
    """`--reduce_dtype auto` sums bfloat16 gradients in bfloat16 on two ranks because NCCL's result there has the
    bits of the float32 sum rounded back: all-reduce (DDP) and reduce-scatter (FSDP2), 2^26 values over 2^±60."""
    import subprocess
    import sys

    script = tmp_path / "sums.py"
    script.write_text(_NCCL_SUMS)
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", str(script)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_full_shard_on_two_gpus_saves_evaluates_and_trains_like_one(tmp_path, model_dirs):
    """FSDP2 full_shard over NCCL on two GPUs, float32, with a checkpoint and an evaluation after step 2 (between an
    update and the next step): the held-out scores and the final weights match one GPU's run of the same global
    batch, and the checkpoint resumes to the same weights."""
    import json
    import subprocess
    import sys

    from data_helpers import easy_rows, write_jsonl
    from safetensors.torch import load_file

    data, val = write_jsonl(tmp_path / "d.jsonl", easy_rows(32, seed=1)), write_jsonl(tmp_path / "v.jsonl",
                                                                                        easy_rows(6, seed=5))
    common = ["-m", "fastdpo", "train", "--model", str(model_dirs("qwen3")), "--dataset", str(data), "--val_dataset",
              str(val), "--eval_steps", "2", "--save_steps", "2", "--max_steps", "4", "--torch_dtype", "float32",
              "--learning_rate", "1e-3", "--seed", "3", "--disable_progress", "true", "--gradient_accumulation_steps", "2"]

    def run(out, *extra, gpus=2):
        launch = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(gpus)] if gpus > 1 \
            else [sys.executable]
        done = subprocess.run(launch + common + ["--output_dir", str(tmp_path / out), *extra], capture_output=True,
                              text=True, timeout=400)
        assert done.returncode == 0, done.stderr[-4000:]
        rows = [json.loads(line) for line in open(tmp_path / out / "metrics.jsonl")]
        return [r for r in rows if "eval_loss" in r], load_file(str(tmp_path / out / "final" / "model.safetensors"))

    evals2, w2 = run("two", "--fsdp", "full_shard", "--per_device_train_batch_size", "2")
    evals1, w1 = run("one", "--per_device_train_batch_size", "4", gpus=1)
    assert [r["step"] for r in evals2] == [r["step"] for r in evals1] == [2, 4]
    for x, y in zip(evals2, evals1):
        assert x["eval_loss"] == pytest.approx(y["eval_loss"], rel=1e-4, abs=1e-5), x["step"]
    assert sorted(w2) == sorted(w1)
    for k in w1:
        torch.testing.assert_close(w2[k], w1[k], rtol=0, atol=1e-4, msg=k)
    _, resumed = run("resumed", "--fsdp", "full_shard", "--per_device_train_batch_size", "2",
                     "--resume_from_checkpoint", str(tmp_path / "two" / "checkpoint-2"))
    for k in w2:
        torch.testing.assert_close(resumed[k], w2[k], rtol=0, atol=1e-5, msg=k)


def test_fused_adamw_scales_the_gradients_it_reads():
    """`scale` (clipping's coefficient, on the device) multiplies each gradient as the kernel reads it: the update of
    gradients scaled beforehand in float32, and the gradients themselves left as they were. Not bit for bit: the
    compiler fuses the product into the moments' multiply-adds (one rounding fewer), so the two differ by float32
    rounding (Triton's interpreter, which fuses nothing, gives the same bits: tests/kernels/test_adamw_kernel.py)."""
    from fastdpo.kernels.adamw import adamw_update_

    torch.manual_seed(0)
    ok = torch.ones(1, dtype=torch.bool, device="cuda")
    coef = torch.tensor([0.0123], device="cuda")
    kw = dict(lr=1e-3, weight_decay=0.1, b1=0.9, b2=0.999, step=3, eps=1e-8, seeds=[11, 12], stochastic=False)
    ws = [torch.randn(n, device="cuda") * 0.02 for n in (70_001, 300)]
    gs = [torch.randn_like(w) for w in ws]
    ms = [torch.randn_like(w) * 1e-3 for w in ws]
    vs = [torch.rand_like(w) * 1e-6 for w in ws]
    start = [[t.clone() for t in lst] for lst in (ws, gs, ms, vs)]
    pre = [[t.clone() for t in lst] for lst in start]
    pre[1] = [g * coef for g in pre[1]]
    adamw_update_(ws, gs, ms, vs, ok, scale=coef, **kw)
    adamw_update_(*pre, ok, **kw)

    def close(a, b):  # a few float32 roundings of each tensor's own magnitude
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6 * b.abs().max().item())

    for a, b in zip(ws + ms + vs, pre[0] + pre[2] + pre[3]):
        close(a, b)
    assert all(torch.equal(a, b) for a, b in zip(gs, start[1]))
    adamw_update_(*start, ok, **kw)  # unscaled: a difference the comparison above would have caught
    for a, b in ((start[2][0], ms[0]), (start[3][0], vs[0]), (start[0][0], ws[0])):
        with pytest.raises(AssertionError):
            close(a, b)
