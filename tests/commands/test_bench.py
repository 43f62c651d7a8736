"""`fastdpo bench` pieces that run on CPU: static micro-batch lengths, the longest-pair probe, QLoRA's clear error,
and activation offloading (gradients unchanged)."""

import json
import os

import pytest
import torch
from data_helpers import easy_rows

from fastdpo.config import TrainConfig
from fastdpo.errors import FastDPOError
from fastdpo.model.backend import FLEX_PAD, SHAPE_BUCKETS, flex_length


def test_flex_length_uses_few_static_shapes():
    budget = 4096
    lengths = {flex_length(t, budget) for t in range(1, budget + 1)}
    assert len(lengths) == SHAPE_BUCKETS
    assert max(lengths) == budget
    for t in (1, 1000, 1024, 1025, 3000, 4096):
        n = flex_length(t, budget)
        assert n >= t and n % FLEX_PAD == 0 and n - t < budget // SHAPE_BUCKETS
    assert flex_length(4200, budget, 4) == 5120 and flex_length(9000, budget, 4) == 9216  # longer: quarter steps
    assert flex_length(4200, budget, 16) == 4352 and flex_length(9000, budget, 16) == 9216  # sixteenth steps
    assert flex_length(300, 0) == 384  # no budget: the next flex block
    assert flex_length(100, 200) == 128 and flex_length(200, 200) == 256  # tiny budgets: whole blocks


@pytest.mark.parametrize("n", [1, 8, 16])
def test_length_buckets_set_the_static_lengths(n):
    """--length_buckets N: a budget's micro-batches take N static lengths, each padded by less than budget / N."""
    from fastdpo.data.tokenize import TokenizedPair
    from fastdpo.model.backend import Backend, make_batch

    budget = 8192
    lengths = {flex_length(t, budget, n) for t in range(1, budget + 1)}
    assert len(lengths) == n and max(lengths) == budget
    assert all(0 <= flex_length(t, budget, n) - t < budget // n for t in range(1, budget + 1, 37))
    pair = TokenizedPair(prompt=[5] * 700, chosen=[6] * 300, rejected=[7] * 250, index=0)
    batch = make_batch([pair], Backend("flex", None, n), 0, torch.device("cpu"), budget)
    assert batch.input_ids.shape[1] == flex_length(1250, budget, n) == -(-1250 // (budget // n)) * (budget // n)


def test_length_buckets_are_checked():
    with pytest.raises(FastDPOError, match="--length_buckets must be between 1 and 64"):
        TrainConfig(model="m", dataset=["x"], length_buckets=0).validate()


def _cfg(tmp_path, model_dirs, **kw):
    return TrainConfig(model=str(model_dirs("qwen3")), dataset=["x"], output_dir=str(tmp_path / "o"), **kw)


def test_longest_pair_probe_stops_at_first_oom(tmp_path, model_dirs, monkeypatch):
    from fastdpo.commands import bench
    from fastdpo.training import trainer as train

    real = train.run_step

    def fake(s, pairs, m, ahead=None):
        if pairs[0].num_tokens > 200:
            raise torch.OutOfMemoryError("CUDA out of memory")
        return real(s, pairs, m, ahead)

    monkeypatch.setattr(train, "run_step", fake)
    out = tmp_path / "long.json"
    res = bench.run_longest(_cfg(tmp_path, model_dirs, max_tokens_per_batch=64), None, [400, 96, 160, 800],
                            str(out), console=None)
    assert [r["fits"] for r in res] == [True, True, False]  # 800 is never tried
    assert 96 <= res[0]["pair_tokens"] < res[1]["pair_tokens"] < res[2]["pair_tokens"]
    assert json.loads(out.read_text())["longest"] == res


def test_long_pair_rows_split():
    from fastdpo.data.anchor import long_pair_rows

    r = long_pair_rows(1000)
    assert [len(r[k].split()) for k in ("prompt", "chosen", "rejected")] == [500, 250, 250]


def test_qlora_bench_on_cpu_is_a_clear_error(tmp_path, model_dirs):
    from fastdpo.model.shapes import bench_model

    cfg = _cfg(tmp_path, model_dirs, train_type="qlora", quant_bits=4)
    with pytest.raises(FastDPOError, match="needs a CUDA GPU"):
        bench_model(cfg, None, torch.device("cpu"), torch.float32)


def test_activation_offloading_keeps_gradients(model_dirs):
    from fastdpo.model.load import load_model
    from fastdpo.model.memory import OffloadActivations

    model = load_model(str(model_dirs("qwen3")), torch.float32, torch.device("cpu"))
    ids = torch.randint(4, 60, (2, 24))

    def grads(ctx):
        model.zero_grad(set_to_none=True)
        with ctx:
            loss = model(input_ids=ids).logits.float().logsumexp(-1).mean()
        loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    import contextlib

    plain = grads(contextlib.nullcontext())
    hooks = OffloadActivations(model, min_bytes=0)
    offloaded = grads(hooks)
    assert hooks.offloaded_bytes > 0
    assert plain.keys() == offloaded.keys()
    for n in plain:
        torch.testing.assert_close(offloaded[n], plain[n], rtol=0, atol=0, msg=n)


def test_activation_offloading_skips_parameters(model_dirs):
    from fastdpo.model.load import load_model
    from fastdpo.model.memory import OffloadActivations

    model = load_model(str(model_dirs("qwen3")), torch.float32, torch.device("cpu"))
    seen = []
    hooks = OffloadActivations(model, min_bytes=0)
    pack = hooks.pack_hook
    param_ptrs = {p.untyped_storage().data_ptr() for p in model.parameters()}

    def spy(t):
        out = pack(t)
        seen.append((t.untyped_storage().data_ptr() in param_ptrs, isinstance(out, tuple)))
        return out

    hooks.pack_hook = spy
    with hooks:
        model(input_ids=torch.randint(4, 60, (1, 16))).logits.sum().backward()
    assert any(is_param for is_param, _ in seen) and any(moved for _, moved in seen)
    assert not any(is_param and moved for is_param, moved in seen)


def test_activation_offloading_refuses_fsdp():
    with pytest.raises(FastDPOError, match="activation_offloading"):
        TrainConfig(model="m", dataset=["d"], activation_offloading=True, fsdp="full_shard").validate()


def test_training_with_offloading_matches(tmp_path, model_dirs, monkeypatch):
    from data_helpers import write_jsonl
    from safetensors.torch import load_file

    from fastdpo.model import memory
    from fastdpo.training.loop import train

    moved = []
    real_init = memory.OffloadActivations.__init__

    def init(self, model, min_bytes=None):
        real_init(self, model, 0)  # the tiny model's activations are all small: offload every one
        moved.append(self)

    monkeypatch.setattr(memory.OffloadActivations, "__init__", init)

    data = write_jsonl(tmp_path / "data.jsonl", easy_rows(16, seed=1))
    weights = {}
    for flag in (False, True):
        cfg = TrainConfig(model=str(model_dirs("qwen3")), dataset=[str(data)], output_dir=str(tmp_path / f"o{flag}"),
                          max_steps=2, learning_rate=1e-3, activation_offloading=flag, seed=3)
        weights[flag] = load_file(f"{train(cfg, progress=False)['final_dir']}/model.safetensors")
    assert moved and sum(h.offloaded_bytes for h in moved) > 0
    for n in weights[False]:
        torch.testing.assert_close(weights[True][n], weights[False][n], rtol=0, atol=0, msg=n)


def test_warm_up_lengths_leaves_no_gradients(tmp_path, model_dirs):
    from fastdpo.model.load import load_model, load_tokenizer
    from fastdpo.training.setup import assemble
    from fastdpo.training.trainer import warm_up_lengths

    cfg = _cfg(tmp_path, model_dirs, max_tokens_per_batch=512)
    path = str(model_dirs("qwen3"))
    model = load_model(path, torch.float32, torch.device("cpu"))
    s = assemble(cfg, torch.device("cpu"), model, load_tokenizer(path), [])
    assert warm_up_lengths(s) == 4  # one per 128-token flex block of 512
    assert all(p.grad is None for p in s.model.parameters())
    cfg = _cfg(tmp_path, model_dirs, max_tokens_per_batch=1024, length_buckets=8)  # eighths of 1024
    assert warm_up_lengths(assemble(cfg, torch.device("cpu"), model, load_tokenizer(path), [])) == 8
    cfg = _cfg(tmp_path, model_dirs, max_tokens_per_batch=512, length_buckets=8)  # at most one per flex block
    assert warm_up_lengths(assemble(cfg, torch.device("cpu"), model, load_tokenizer(path), [])) == 512 // FLEX_PAD


def test_compile_layers_makes_frozen_embeddings_output_require_grad(model_dirs):
    from fastdpo.model.load import add_lora, load_model
    from fastdpo.model.memory import compile_layers

    model = add_lora(load_model(str(model_dirs("qwen3")), torch.float32, torch.device("cpu")), 4, 8, 0.0, "all-linear")
    emb = model.get_input_embeddings()
    assert not emb(torch.tensor([[5, 6]])).requires_grad
    compile_layers(model)
    assert emb(torch.tensor([[5, 6]])).requires_grad


def test_config_default_lengths_match_the_model_default():
    assert TrainConfig(model="m", dataset=["x"]).length_buckets == SHAPE_BUCKETS


def test_compile_layers_refuses_cuda_graphs(model_dirs):
    """CUDA graphs replay one graph for every layer, overwriting the outputs the backward still needs: a clear error."""
    import torch._inductor.config

    from fastdpo.model.load import load_model
    from fastdpo.model.memory import compile_layers

    model = load_model(str(model_dirs("qwen3")), torch.float32, torch.device("cpu"))
    with torch._inductor.config.patch({"triton.cudagraphs": True}):
        with pytest.raises(FastDPOError, match="Unset TORCHINDUCTOR_CUDAGRAPHS"):
            compile_layers(model)


def test_compiled_lengths_stay_compiled(model_dirs):
    """Past Dynamo's recompile limit a function runs uncompiled, and uncompiled flex attention materializes every score:
    the flex kernel and the compiled layers raise the limit to cover their lengths, and never lower a larger one."""
    import torch._dynamo

    from fastdpo.model import attention
    from fastdpo.model.load import load_model
    from fastdpo.model.memory import compile_layers

    name = "recompile_limit" if hasattr(torch._dynamo.config, "recompile_limit") else "cache_size_limit"
    model = load_model(str(model_dirs("qwen3")), torch.float32, torch.device("cpu"))
    try:
        with torch._dynamo.config.patch({name: 8}):  # restored on exit
            attention._compiled_flex.cache_clear()
            attention._compiled_flex()
            assert getattr(torch._dynamo.config, name) == attention.FLEX_RECOMPILES
        with torch._dynamo.config.patch({name: 8}):
            compile_layers(model, lengths=64)
            assert getattr(torch._dynamo.config, name) == 2 * 64 + 16
            attention.allow_recompiles(10)
            assert getattr(torch._dynamo.config, name) == 2 * 64 + 16
    finally:
        attention._compiled_flex.cache_clear()


def test_flex_without_a_budget_gets_one(tmp_path, model_dirs, monkeypatch, caplog):
    """FlexAttention builds kernels per micro-batch length: a run without --max_tokens_per_batch gets a budget
    (logged), compiled layers or not, so its micro-batches take a few static lengths."""
    from fastdpo.data.tokenize import TokenizedPair
    from fastdpo.model.backend import Backend, flex_budget
    from fastdpo.model.load import load_model, load_tokenizer
    from fastdpo.training import setup as train_mod

    pairs = [TokenizedPair(prompt=[5] * 300, chosen=[6] * 100, rejected=[7] * 100, index=i) for i in range(6)]
    pairs.append(TokenizedPair(prompt=[5] * 2000, chosen=[6] * 600, rejected=[7] * 600, index=6))
    assert flex_budget(pairs, 8) == 7168  # 8 x ~886 tokens, rounded up to 1024s
    assert flex_budget(pairs, 1) == 4096  # never below the longest pair (3200)
    monkeypatch.setattr(train_mod, "choose_backend", lambda *a: Backend("flex"))
    from fastdpo.parallel import parallelize

    monkeypatch.setattr(parallelize, "compile_layers", lambda model, **kw: None)
    monkeypatch.setattr(train_mod, "prepare_packed", lambda *a: None)
    path = str(model_dirs("qwen3"))
    cfg = _cfg(tmp_path, model_dirs, torch_compile=True, per_device_train_batch_size=2)
    monkeypatch.setenv("TORCHINDUCTOR_CPP_WRAPPER", "1")  # a compile setting from the environment is logged
    with caplog.at_level("INFO", logger="fastdpo"):
        got = train_mod.assemble(cfg, torch.device("cpu"), load_model(path, torch.float32, torch.device("cpu")),
                                 load_tokenizer(path), pairs)
    assert got.plan.max_tokens_per_batch == 4096 and cfg.max_tokens_per_batch == 0
    assert "torch.compile settings from the environment: TORCHINDUCTOR_CPP_WRAPPER=1" in caplog.text
    monkeypatch.delenv("TORCHINDUCTOR_CPP_WRAPPER")
    kept = _cfg(tmp_path, model_dirs, torch_compile=True, max_tokens_per_batch=512)
    got = train_mod.assemble(kept, torch.device("cpu"), load_model(path, torch.float32, torch.device("cpu")),
                             load_tokenizer(path), pairs)
    assert got.plan.max_tokens_per_batch == 512
    eager = _cfg(tmp_path, model_dirs, per_device_train_batch_size=8)  # no --torch_compile: the flex kernel alone
    with caplog.at_level("INFO", logger="fastdpo"):
        got = train_mod.assemble(eager, torch.device("cpu"), load_model(path, torch.float32, torch.device("cpu")),
                                 load_tokenizer(path), pairs)
    assert got.plan.max_tokens_per_batch == 7168
    assert "FlexAttention: micro-batches use a token budget of 7168" in caplog.text
    monkeypatch.setattr(train_mod, "choose_backend", lambda *a: Backend("dense"))
    dense = _cfg(tmp_path, model_dirs, per_device_train_batch_size=8)  # dense (CPU): pair counts, as asked
    got = train_mod.assemble(dense, torch.device("cpu"), load_model(path, torch.float32, torch.device("cpu")),
                             load_tokenizer(path), pairs)
    assert got.plan.max_tokens_per_batch == 0


def test_bench_command_on_cpu_with_a_profile(tmp_path, model_dirs, capsys):
    from data_helpers import write_jsonl

    from fastdpo.cli import main

    data = write_jsonl(tmp_path / "d.jsonl", easy_rows(16, seed=2))
    out, prof = tmp_path / "b.json", tmp_path / "prof"
    rc = main(["bench", "--model", str(model_dirs("qwen3")), "--dataset", str(data), "--steps", "2", "--warmup", "1",
               "--per_device_train_batch_size", "4", "--json", str(out), "--profile", str(prof)])
    text = capsys.readouterr().out
    assert rc == 0 and "fastdpo bench" in text and "Profile of two steps" in text
    r = json.loads(out.read_text())["results"][0]
    assert r["pairs_per_s"] > 0 and r["backend"] == "dense" and r["padding"] == 0  # packed: no filler on CPU
    assert r["profile"]["time"] == "cpu" and r["profile"]["top"][0]["self_ms"] > 0
    assert json.loads((prof / "trace.json").read_text())["traceEvents"]
    top = (prof / "top.txt").read_text().splitlines()
    assert top[0].split()[:2] == ["self", "ms/step"] and len(top) > 5
    # the CPU runs every op as it is queued: the step's host time is nearly all of it, its wait nearly nothing (the
    # queue time is a median and rounded to 0.1 ms, the step time a mean: a median may pass the mean a little)
    assert 0 < r["host_queue_ms"] <= r["s_per_step"] * 1e3 * 1.25 + 0.1
    assert 0 <= r["device_wait_ms"] < r["host_queue_ms"]
    assert "the host queued it in" in text
    # the run's certificate, checked by the first (warm-up) step, as training checks it
    assert r["certificate"]["status"] == "PASS" and r["certificate"]["checks"]["fast_path"][0] == "PASS"
    assert set(r["certificate"]["checks"]) == {"fast_path", "head_float32", "reference_at_start", "reference_apart"}
    assert "certificate PASS in" in text


def test_bench_trains_kto_on_the_pairs_unpaired(tmp_path, model_dirs):
    """`fastdpo bench --loss_type kto`: each pair gives two unpaired rows (as TRL's KTOTrainer unpairs them), a step
    takes --per_device_train_batch_size rows, one chunk per micro-batch."""
    from data_helpers import write_jsonl

    from fastdpo.cli import main

    data = write_jsonl(tmp_path / "d.jsonl", easy_rows(6, seed=2))
    out = tmp_path / "b.json"
    rc = main(["bench", "--model", str(model_dirs("qwen3")), "--dataset", str(data), "--steps", "2", "--warmup", "1",
               "--per_device_train_batch_size", "4", "--loss_type", "kto", "--json", str(out)])
    r = json.loads(out.read_text())["results"][0]
    assert rc == 0 and r["pairs_per_s"] > 0 and r["reference"] != "none"
    rc = main(["bench", "--model", str(model_dirs("qwen3")), "--dataset", str(data), "--steps", "4", "--warmup", "1",
               "--per_device_train_batch_size", "4", "--loss_type", "kto"])
    assert rc != 0  # 20 rows needed, 12 given


def test_the_host_line_says_which_side_set_the_pace():
    from fastdpo.commands.bench import host_line

    assert "the CPU set the pace" in host_line({"host_queue_ms": 366.8, "device_wait_ms": 0.1})
    assert "the device set the pace" in host_line({"host_queue_ms": 216.0, "device_wait_ms": 27.7})
    assert host_line({"impl": "trl"}) is None



def test_bench_schedules_and_reports_garbage_collection(tmp_path, model_dirs):
    """`fastdpo bench --gc_steps 1`: one collection per timed step (the warm-up's not counted), Python's collector
    back on afterwards."""
    import gc

    from data_helpers import write_jsonl

    from fastdpo.cli import main

    data = write_jsonl(tmp_path / "d.jsonl", easy_rows(16, seed=2))
    out = tmp_path / "b.json"
    rc = main(["bench", "--model", str(model_dirs("qwen3")), "--dataset", str(data), "--steps", "2", "--warmup", "1",
               "--per_device_train_batch_size", "4", "--json", str(out), "--gc_steps", "1"])
    r = json.loads(out.read_text())["results"][0]
    assert rc == 0 and r["gc_collections"] == 2 and r["gc_pause_ms"] > 0
    assert gc.isenabled() and gc.get_freeze_count() == 0

def test_compare_runs_checks_the_loss_curve(tmp_path, capsys):
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(
        "compare_runs", Path(__file__).resolve().parents[2] / "benchmarks" / "compare_runs.py")
    cr = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cr)

    def run(name, losses, rate, peak, first=1):
        d = tmp_path / name
        d.mkdir()
        rows = [{"step": first + i, "loss": v, "pairs_per_second": rate, "memory/peak_gib": peak}
                for i, v in enumerate(losses)]
        rows.append({"step": first, "eval_loss": 0.6})  # an evaluation record: ignored
        (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        return str(d)

    one = run("one", [0.69, 0.68, 0.66, 0.65], 10.0, 20.0)
    two = run("two", [0.69, 0.6801, 0.6601, 0.6499], 19.0, 12.0)
    off = run("off", [0.69, 0.68, 0.70, 0.65], 19.0, 12.0)
    resumed = run("resumed", [0.66, 0.65], 10.0, 20.0, first=3)
    assert cr.main([f"{one}:1", f"{two}:2", "--skip", "1"]) == 0
    out = capsys.readouterr().out
    assert "| 95.0% |" in out and "| 12.0 |" in out  # 19 pairs/s on 2 GPUs = 9.5 per GPU vs 10
    copied = tmp_path / "two.metrics.jsonl"  # a run's metrics file copied on its own
    copied.write_text((Path(two) / "metrics.jsonl").read_text())
    assert cr.main([f"{one}:1", f"{copied}:2", "--skip", "1"]) == 0 and "| 95.0% |" in capsys.readouterr().out
    assert cr.main([f"{one}:1", f"{off}:2"]) == 1  # step 3 is 6 % off
    assert cr.main([f"{one}:1", f"{resumed}:1"]) == 1  # only 2 of 4 steps: incomplete unless --overlap
    assert cr.main([f"{one}:1", f"{resumed}:1", "--overlap"]) == 0
    capsys.readouterr()
    failed = tmp_path / "failed"
    failed.mkdir()  # a run that died before its first step: named, the others still compared
    assert cr.main([f"{one}:1", f"{failed}:2", f"{two}:2", "--skip", "1"]) == 1
    out = capsys.readouterr().out
    assert "| 95.0% |" in out and f"{failed}: no metrics.jsonl" in out
    assert cr.main([f"{failed}:1", f"{one}:1"]) == 1 and "nothing to compare" in capsys.readouterr().out



def test_scaling_table_sums_the_window_and_compares_with_one_gpu(tmp_path, capsys):
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(
        "scaling_table", Path(__file__).resolve().parents[2] / "benchmarks" / "scaling_table.py")
    st = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(st)

    def run(name, rates, peak=10.0, padding=None):  # rates: pairs/s of steps 1, 2, ...
        rows = [{"step": i + 1, "loss": 0.69, "pairs_per_second": r, "memory/peak_gib": peak}
                | ({} if padding is None else {"batch/padding": padding[i]}) for i, r in enumerate(rates)]
        (tmp_path / f"{name}.metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))

    run("1gpu_4096", [1, 1, 8, 8, 8, 4, 1], peak=20.0)  # steps 3-6 at 8 pairs each: 1 + 1 + 1 + 2 = 5 s
    run("ddp_4096", [1, 1, 16, 16, 16, 8, 1], padding=[0.9, 0.9, 0.05, 0.07, 0.06, 0.06, 0.9])  # 2.5 s: 100 %
    run("ddp_4096_r2", [1, 1, 8, 8, 8, 8, 1])  # 4 s: 62.5 %
    run("before_ddp_4096", [9, 9, 8, 8, 8, 4, 9])  # 5 s: 50 %, only the window counts
    run("before_1gpu_4096", [1, 1, 16, 16, 16, 8, 1])  # listed, not the reference
    run("full_shard_4096", [1, 1, 16])  # died in step 4
    assert st.main([str(tmp_path), "--pairs", "8", "--first", "3", "--last", "6"]) == 0
    rows = {line.split(" | ")[0].strip("| "): line for line in capsys.readouterr().out.splitlines()}
    assert "| 5.000 s | – | 20.00 | – |" in rows["1gpu_4096"]  # older logs: no padding logged
    assert "| 2.500 s | 100.0 % | 10.00 | 6.0 % |" in rows["ddp_4096"]  # the window's steps only
    assert "| 4.000 s | 62.5 % |" in rows["ddp_4096_r2"]
    assert "| 3.250 s | 81.2 % |" in rows["ddp_4096 (mean of 2)"]
    assert "| 5.000 s | 50.0 % |" in rows["before_ddp_4096"]
    assert "| 2.500 s | – |" in rows["before_1gpu_4096"]
    assert "incomplete" in rows["full_shard_4096"]
    assert st.main([str(tmp_path / "none"), "--pairs", "8"]) == 2

def test_trace_gaps_splits_device_time_by_the_hosts_phase(tmp_path):
    import gzip
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(
        "trace_gaps", Path(__file__).resolve().parents[2] / "benchmarks" / "trace_gaps.py")
    tg = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tg)

    def x(cat, name, ts, dur, tid=10, **args):
        return {"ph": "X", "cat": cat, "name": name, "pid": 1, "tid": tid, "ts": ts, "dur": dur, "args": args}

    events = [
        x("user_annotation", "fastdpo.forward", 0, 1000),
        x("user_annotation", "fastdpo.update", 1500, 1000),
        x("user_annotation", "FSDP::pre_forward", 10, 100),
        x("cpu_op", "aten::mm", 200, 50),
        x("cuda_runtime", "cudaLaunchKernel", 210, 5, correlation=1),
        x("cpu_op", "aten::add", 1990, 20),
        x("cuda_runtime", "cudaLaunchKernel", 1995, 5, correlation=2),
        x("kernel", "gemm", 250, 600, tid=7, correlation=1),  # compute 250-850
        x("kernel", "ncclDevKernel_AllGather_RING_LL", 700, 400, tid=9, correlation=3),  # exposed 850-1100
        x("kernel", "add", 2000, 500, tid=7, correlation=2),  # after an idle gap 1100-2000, launched late
    ]
    path = tmp_path / "trace.json.gz"
    path.write_bytes(gzip.compress(json.dumps({"traceEvents": events}).encode()))
    out = tg.analyse(path, top=5, min_gap_us=100)
    lines = {line.split()[0]: line.split() for line in out.splitlines()[2:] if line.strip()}
    # window 0-2500: compute 600 + 500, exposed 250 (850-1100), idle 0-250 and 1100-2000
    assert "window 2.5 ms; compute 1.1 ms, idle 1.1 ms, exposed communication 0.2 ms" in out.splitlines()[0]
    assert lines["fastdpo.forward"][1:] == ["1", "1.0", "0.6", "0.2", "0.1"]  # in 0-1000: idle 0-250, exposed 850-1000
    assert lines["fastdpo.update"][1:] == ["1", "1.0", "0.5", "0.5", "0.0"]
    assert lines["AllGather"][1:] == ["1", "0.4", "0.2"]
    gap = next(line for line in out.splitlines() if " add <- " in line)
    assert "fastdpo.update" in gap and "aten::add / fastdpo.update (main)" in gap  # the phase that launched it


def test_kernel_diff_sums_device_time_by_kernel_per_step(tmp_path, capsys):
    import gzip
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(
        "kernel_diff", Path(__file__).resolve().parents[2] / "benchmarks" / "kernel_diff.py")
    kd = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(kd)

    def trace(name, events):
        path = tmp_path / name
        rows = [{"ph": "X", "cat": c, "name": n, "ts": i, "dur": d} for i, (c, n, d) in enumerate(events)]
        path.write_bytes(gzip.compress(json.dumps({"traceEvents": rows}).encode()))
        return path

    before = trace("a.json.gz", [("kernel", "gemm", 4000), ("kernel", "gemm", 4000), ("kernel", "mul", 600),
                                 ("gpu_memcpy", "Memcpy HtoD", 200), ("cpu_op", "aten::mm", 9000)])
    after = trace("b.json.gz", [("kernel", "gemm", 4000), ("kernel", "gemm", 4200), ("gpu_memcpy", "Memcpy HtoD", 200)])
    kd.main([str(before), str(after), "--steps", "2"])
    out = capsys.readouterr().out.splitlines()
    # per step: before 8.0 + 0.3 + 0.1 (the host's op not counted), after 8.2 + 0.1
    assert out[0] == "device time per step: before 4.40 ms, after 4.20 ms, change -0.20 ms"
    assert out[2].split() == ["0.300", "0.000", "-0.300", "mul"]  # the largest change first
    assert out[3].split() == ["4.000", "4.100", "+0.100", "gemm"]


def test_speed_hint_names_the_missing_settings():
    from fastdpo.config import RunPlan
    from fastdpo.training.setup import speed_hint

    def named(cfg, *a):
        return speed_hint(cfg, RunPlan.of(cfg), *a)

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    plain = TrainConfig(model="m", dataset=["d"], gradient_checkpointing="none")  # as `fit` resolves with room
    hint = named(plain, cuda, "flex")
    for flag in ("--torch_compile", "--max_tokens_per_batch 4096", "--gradient_checkpointing ffn",
                 "--precompute_ref_log_probs", "fastdpo tune"):
        assert flag in hint
    assert named(plain, cpu, "dense") is None and named(plain, cuda, "padded") is None
    sharded = TrainConfig(model="m", dataset=["d"], torch_compile=True, max_tokens_per_batch=4096, fsdp="full_shard")
    assert "--max_tokens_per_batch 8192" in named(sharded, cuda, "flex", "fsdp")
    assert "--fsdp shard_grad_op" in named(sharded, cuda, "flex", "fsdp")
    zero2 = named(sharded, cuda, "flex", "fsdp_zero2")  # one gather per step already; host-bound when small
    assert "--max_tokens_per_batch 8192" in zero2 and "--fsdp shard_grad_op" not in zero2
    assert named(sharded, cuda, "flex", "ddp") != named(sharded, cuda, "flex", "fsdp")
    sharded.max_tokens_per_batch = 8192
    assert "FSDP2" not in (named(sharded, cuda, "flex", "fsdp") or "")
    assert "FSDP2" not in (named(sharded, cuda, "flex", "fsdp_zero2") or "")
    tuned = TrainConfig(model="m", dataset=["d"], torch_compile=True, max_tokens_per_batch=4096,
                        gradient_checkpointing="ffn", precompute_ref_log_probs=True)
    assert named(tuned, cuda, "flex") is None
    lora = TrainConfig(model="m", dataset=["d"], train_type="lora", torch_compile=True, max_tokens_per_batch=4096,
                       gradient_checkpointing="full")
    assert "--precompute_ref_log_probs" in named(lora, cuda, "flex")  # saves the adapters-off forward too
    free = TrainConfig(model="m", dataset=["d"], loss_type="simpo", torch_compile=True, max_tokens_per_batch=4096,
                       gradient_checkpointing="full")
    assert named(free, cuda, "flex") is None  # reference-free: nothing to precompute


def test_compile_warmup_leaves_training_unchanged(tmp_path, model_dirs, caplog):
    """--compile_warmup runs a forward and backward per length before step 1; the run must then be the run without
    it, bit for bit: gradients discarded, the random state (LoRA dropout here) restored."""
    from data_helpers import write_jsonl
    from dist_helpers import metrics
    from safetensors.torch import load_file

    from fastdpo.training.loop import train

    data = write_jsonl(tmp_path / "d.jsonl", easy_rows(12, seed=1))
    common = dict(model=str(model_dirs("qwen3")), dataset=[str(data)], max_steps=3, per_device_train_batch_size=4,
                  max_tokens_per_batch=512, train_type="lora", lora_rank=4, lora_alpha=8, lora_dropout=0.3,
                  learning_rate=1e-3, seed=5, disable_progress=True)
    with caplog.at_level("INFO", logger="fastdpo"):
        train(TrainConfig(output_dir=str(tmp_path / "warm"), compile_warmup=True, **common), progress=False)
    assert "kernels for 4 micro-batch lengths built" in caplog.text
    train(TrainConfig(output_dir=str(tmp_path / "cold"), **common), progress=False)
    a, b = (load_file(str(tmp_path / d / "final" / "adapter_model.safetensors")) for d in ("warm", "cold"))
    assert a.keys() == b.keys() and len(a) > 0
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=0, msg=k)
    assert [r["loss"] for r in metrics(tmp_path / "warm")] == [r["loss"] for r in metrics(tmp_path / "cold")]
    no_budget = {**common, "max_tokens_per_batch": 0, "max_steps": 1}  # dense on CPU: no static lengths
    caplog.clear()
    with caplog.at_level("INFO", logger="fastdpo"):
        train(TrainConfig(output_dir=str(tmp_path / "nb"), compile_warmup=True, **no_budget), progress=False)
    assert "--compile_warmup: nothing to build without a token budget" in caplog.text


def test_bench_environment_records_compile_variables(monkeypatch):
    from fastdpo.commands.bench import environment

    for k in [k for k in os.environ if k.startswith(("TORCHINDUCTOR_", "TORCHDYNAMO_", "TORCH_COMPILE_"))]:
        monkeypatch.delenv(k)
    assert "compile_env" not in environment()
    monkeypatch.setenv("TORCHINDUCTOR_CPP_WRAPPER", "1")
    monkeypatch.setenv("TORCHINDUCTOR_MAX_AUTOTUNE_PLEASE", "")  # set, even if empty
    monkeypatch.setenv("TORCH_LOGS", "recompiles")  # not a compile setting of Inductor or Dynamo
    assert environment()["compile_env"] == {"TORCHINDUCTOR_CPP_WRAPPER": "1", "TORCHINDUCTOR_MAX_AUTOTUNE_PLEASE": ""}


def test_workloads_keep_the_anchor_and_bound_the_long_ones():
    """The anchor rows stay the reference benchmark's; the long workloads have the lengths they are named for, and
    every pair fits in 4096 tokens."""
    import statistics

    from fastdpo.data.anchor import anchor_pairs, workload_max_length, workload_pairs

    assert workload_pairs("anchor", 40) == anchor_pairs(40)
    for name, prompt_at_least, completion_at_least in (("long-prompt", 1400, 150), ("long-answer", 50, 800)):
        rows = workload_pairs(name, 300)
        lengths = [{k: len(r[k].split()) for k in ("prompt", "chosen", "rejected")} for r in rows]
        assert max(sum(x.values()) for x in lengths) <= workload_max_length(name) == 4096
        assert statistics.mean(x["prompt"] for x in lengths) >= prompt_at_least
        assert statistics.mean(x["chosen"] for x in lengths) >= completion_at_least
    assert statistics.mean(len(r["prompt"].split()) for r in workload_pairs("long-answer", 300)) < 120
    grouped = workload_pairs("grouped", 400)  # 4 consecutive pairs per prompt of at least 500 tokens
    assert [len({r["prompt"] for r in grouped[i:i + 4]}) for i in range(0, 400, 4)] == [1] * 100
    assert len({r["prompt"] for r in grouped}) == 100 and min(len(r["prompt"].split()) for r in grouped) >= 500
    assert all(len(r["prompt"].split()) + len(r["chosen"].split()) + len(r["rejected"].split()) <= 2048
               for r in grouped) and workload_max_length("grouped") == 2048
    with pytest.raises(ValueError, match="unknown workload"):
        workload_pairs("huge", 1)


def test_compare_must_be_like_for_like():
    from fastdpo.commands.bench import trl_variant

    lora = TrainConfig(model="m", dataset=["d"], train_type="lora")
    with pytest.raises(FastDPOError, match="compare with trl-lora-liger"):
        trl_variant("trl-liger", lora)
    assert trl_variant("trl-lora-liger", lora) == "lora_liger"
    with pytest.raises(FastDPOError, match="choose trl, trl-liger"):
        trl_variant("deepspeed", TrainConfig(model="m", dataset=["d"]))


@pytest.mark.parametrize("targets", ["all-linear", "q_proj,v_proj", "default"])
def test_trl_s_side_trains_fastdpo_s_adapter(model_dirs, targets):
    """The LoRA settings handed to TRL's scripts wrap the same modules with the same rank, alpha and dropout as
    fastdpo's `add_lora` does."""

    from peft import LoraConfig, get_peft_model

    from fastdpo.commands.bench import trl_adapter
    from fastdpo.model.load import add_lora, load_model

    cfg = TrainConfig(model="m", dataset=["d"], train_type="lora", lora_rank=6, lora_alpha=12, lora_dropout=0.1,
                      target_modules=targets)

    def wrapped(model):
        return {n: (m.r["default"], m.scaling["default"], m.lora_dropout["default"].p)
                for n, m in model.named_modules() if hasattr(m, "lora_A") and "default" in m.lora_A}

    ours = add_lora(load_model(str(model_dirs("qwen3")), torch.float32, torch.device("cpu")), cfg.lora_rank,
                    cfg.lora_alpha, cfg.lora_dropout, cfg.target_modules)
    theirs = get_peft_model(load_model(str(model_dirs("qwen3")), torch.float32, torch.device("cpu")),
                            LoraConfig(**json.loads(trl_adapter(cfg)), task_type="CAUSAL_LM"))
    assert wrapped(ours) == wrapped(theirs) and next(iter(wrapped(ours).values())) == (6, 2.0, 0.1)


def test_bench_job_times_whole_jobs_from_process_start(tmp_path, capsys):
    """`fastdpo bench --job`: fastdpo train and TRL's DPOTrainer each run as a whole job in a fresh process (empty
    compile caches), on one model dir and rows; both save a model, and fastdpo's timeline says where its time went."""
    pytest.importorskip("trl")
    from fastdpo.cli import main

    out, work = tmp_path / "job.json", tmp_path / "job"
    rc = main(["bench", "--shape", "tiny", "--job", "--rows", "2", "--per_device_train_batch_size", "2",
               "--device", "cpu", "--compare", "trl", "--json", str(out), "--job_dir", str(work)])
    text = capsys.readouterr().out
    assert rc == 0, text
    record = json.loads(out.read_text())
    ours, trl = record["jobs"]
    assert ours["rc"] == 0 and ours["saved"] and trl["rc"] == 0 and trl["saved"], record
    assert record["reference"] == "online" and trl["impl"] == "trl-default"
    marks = ours["timeline_s"]
    assert list(marks) == ["started", "data", "model", "ready", "first_step", "last_step", "saved"]
    assert list(marks.values()) == sorted(marks.values()) and 0 < marks["started"] and marks["saved"] <= ours["wall_s"]
    assert trl["fastdpo_wall_ratio"] == pytest.approx(ours["wall_s"] / trl["wall_s"], abs=1e-3)
    assert (work / "inductor-fastdpo").parent == work and (work / "fastdpo.log").exists()
    assert "process start to saved model" in text
    assert ours["certificate"]["status"] == "PASS" and "of the job" in text
    # a second job never reuses outputs or warm caches
    assert main(["bench", "--shape", "tiny", "--job", "--rows", "2", "--device", "cpu", "--job_dir", str(work)]) != 0
    assert "is not empty" in capsys.readouterr().out


def _trl_trainer(args, rows, model):
    import copy

    from datasets import Dataset
    from trl import DPOTrainer

    from fastdpo.data.anchor import anchor_tokenizer

    return DPOTrainer(model=model, ref_model=copy.deepcopy(model), args=args, train_dataset=Dataset.from_list(rows),
                      processing_class=anchor_tokenizer(model.config.vocab_size))


def _rows_per_step(tr) -> list[list[int]]:
    """Which rows each step of TRL's DPOTrainer takes (indices into its dataset), as its dataloader deals them."""
    prompts = tr.train_dataset["prompt_ids"]
    steps = []
    for b in tr.get_train_dataloader():
        seqs = [b["input_ids"][i][b["attention_mask"][i].bool()].tolist() for i in range(b["input_ids"].shape[0])]
        steps.append([j for j, p in enumerate(prompts) if any(s[:len(p)] == p for s in seqs)])
    return steps


def test_trl_s_steps_take_the_rows_in_fastdpo_s_order(tmp_path):
    """The TRL side of `fastdpo bench` trains on the same pairs in the same steps as fastdpo's timed steps (rows in
    order, `bs` at a time), with transformers' sequential sampler or, where a transformers lacks it, one set on the
    trainer; TRL's own default order (shuffled) would not."""
    pytest.importorskip("trl")
    from transformers import AutoModelForCausalLM
    from trl import DPOConfig

    from fastdpo.commands.bench import in_row_order, trl_steady_args
    from fastdpo.data.anchor import workload_pairs
    from fastdpo.model.shapes import shape_config

    cfg = shape_config("tiny")
    model = AutoModelForCausalLM.from_config(cfg)
    rows = workload_pairs("anchor", 8, vocab=cfg.vocab_size)
    args = trl_steady_args(DPOConfig, 2, 4, 4096, "default", False, bf16=False, output_dir=str(tmp_path))
    assert args.gradient_checkpointing and args.beta == 0.1 and args.per_device_train_batch_size == 2
    in_order = [[0, 1], [2, 3], [4, 5], [6, 7]]
    tr = _trl_trainer(args, rows, model)
    in_row_order(tr)
    assert _rows_per_step(tr) == in_order
    args.train_sampling_strategy = "random"  # TRL's default, or a transformers without the field
    tr = _trl_trainer(args, rows, model)
    shuffled = _rows_per_step(tr)
    assert shuffled != in_order and sorted(sum(shuffled, [])) == list(range(8))
    in_row_order(tr)
    assert _rows_per_step(tr) == in_order
