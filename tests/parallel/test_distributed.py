"""Scale-out on CPU with gloo: rank-aware micro-batches, the --fsdp/--deepspeed mapping, the launcher, and DDP runs
on 2 ranks that match 1 rank, resume on 1 rank from a 2-rank checkpoint, and a killed rank that ends the job."""

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from data_helpers import random_pairs, write_jsonl
from dist_helpers import BASE, assert_weights_close, dataset, join_ranks, metrics, run_isolated, run_ranks, start_ranks, weights

from fastdpo.cli import build_parser, main
from fastdpo.config import TrainConfig, build_config
from fastdpo.config.flags import typed_flags
from fastdpo.config.launch import WORLD_FIELDS, check_world, wants_launch
from fastdpo.errors import FastDPOError
from fastdpo.parallel.distributed import parallel_plan
from fastdpo.parallel.launch import failure_message, torchrun_args
from fastdpo.parallel.split import rank_micro_batches, split_ranks
from fastdpo.training.loop import train

# ---------------------------------------------------------------- pure pieces


def test_split_ranks_gives_equal_pairs_and_balanced_tokens():
    for seed in range(10):
        pairs = random_pairs(16, 60, seed=seed, max_prompt=30, max_comp=20)
        shares = split_ranks(pairs, 4)
        assert [len(s) for s in shares] == [4, 4, 4, 4]
        assert sorted(p.index for s in shares for p in s) == list(range(16))
        loads = [sum(p.num_tokens for p in s) for s in shares]
        assert max(loads) - min(loads) <= max(p.num_tokens for p in pairs)
    assert [len(s) for s in split_ranks(random_pairs(6, 60), 4)] == [2, 2, 1, 1]  # a short last step
    pairs = random_pairs(5, 60)
    assert split_ranks(pairs, 1) == [pairs]  # one process: order untouched


def test_rank_micro_batches_agree_on_the_number_of_micro_steps():
    import random

    r = random.Random(0)
    for trial in range(40):
        n, world = r.randint(1, 20), r.randint(2, 4)
        budget, per_micro = r.choice([0, 40, 80]), r.randint(1, 4)
        pairs = random_pairs(n, 60, seed=trial)
        plans = [rank_micro_batches(pairs, k, world, budget, per_micro) for k in range(world)]
        assert len({len(p) for p in plans}) == 1, (trial, [len(p) for p in plans])
        assert sorted(p.index for plan in plans for g in plan for p in g) == list(range(n))
        for plan in plans:
            for g in plan:
                assert len(g) <= max(per_micro, 1) or budget
                assert not budget or len(g) <= 1 or sum(p.num_tokens for p in g) <= budget
    # one pair on two ranks: rank 1 still runs one (empty, zero-weight) micro-step
    assert rank_micro_batches(random_pairs(1, 60), 1, 2, 0, 2) == [[]]


def test_fsdp_and_deepspeed_names_map_to_ddp_or_fsdp2():
    assert parallel_plan("", "").mode == "ddp"
    assert parallel_plan("no_shard", "").mode == "ddp"
    full = parallel_plan("full_shard auto_wrap", "")
    assert (full.mode, full.reshard_after_forward) == ("fsdp", True)
    z2 = parallel_plan("", "zero2")
    assert (z2.mode, z2.reshard_after_forward) == ("fsdp", False)
    assert "shard_grad_op" in z2.notes[0]
    z3 = parallel_plan("", "zero3")
    assert (z3.mode, z3.reshard_after_forward) == ("fsdp", True)
    for fsdp, ds, needle in [("full_shard", "zero3", "choose one"), ("bogus", "", "full_shard"),
                             ("full_shard offload", "", "offload"), ("", "zero3_offload", "--deepspeed zero3"),
                             ("", "zero9", "zero2, zero3")]:
        with pytest.raises(FastDPOError, match=needle):
            parallel_plan(fsdp, ds)


def test_deepspeed_json_is_mapped_and_accounted_for(tmp_path):
    cfg = TrainConfig(per_device_train_batch_size=2, gradient_accumulation_steps=4)
    ds = {"zero_optimization": {"stage": 3, "overlap_comm": True, "offload_optimizer": {"device": "none"}},
          "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": 4, "bf16": {"enabled": True},
          "optimizer": {"type": "AdamW"}, "steps_per_print": 10}
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(ds))
    plan = parallel_plan("", str(path), cfg)
    assert (plan.mode, plan.reshard_after_forward) == ("fsdp", True)
    mapped, ignored = plan.notes
    assert "stage=3" in mapped and "gradient_accumulation_steps=4" in mapped and "bf16" in mapped
    for key in ("overlap_comm", "optimizer", "steps_per_print"):
        assert key in ignored
    assert "offload" not in ignored  # "device": "none" asks for nothing
    for key, device in (("offload_optimizer", "cpu"), ("offload_param", "nvme")):
        path.write_text(json.dumps({**ds, "zero_optimization": {"stage": 3, key: {"device": device}}}))
        with pytest.raises(FastDPOError, match=f"zero_optimization.{key}.device={device}: DeepSpeed's CPU/NVMe offload"):
            parallel_plan("", str(path), cfg)
        path.write_text(json.dumps(ds))
    ds["gradient_accumulation_steps"] = 8
    path.write_text(json.dumps(ds))
    with pytest.raises(FastDPOError, match="--gradient_accumulation_steps is 4"):
        parallel_plan("", str(path), cfg)
    path.write_text('{"zero_optimization": {\n "stage": 2,\n}')
    with pytest.raises(FastDPOError, match="line 3"):
        parallel_plan("", str(path), cfg)


def test_bad_parallel_flag_is_one_clean_message(capsys, tmp_path):
    assert main(["train", "--model", "m", "--dataset", "d.jsonl", "--fsdp", "full_shardd"]) == 1
    out = capsys.readouterr().out
    assert "--fsdp 'full_shardd'" in out and "Traceback" not in out


def test_nproc_per_node_becomes_a_torchrun_command():
    env = {"NPROC_PER_NODE": "4"}
    assert wants_launch(env) and not wants_launch({**env, "LOCAL_RANK": "0"})
    args = torchrun_args(["train", "--model", "m"], env, visible_gpus=8)
    assert args[:2] == ["--nproc_per_node", "4"] and "--standalone" in args
    assert args[-4:] == ["fastdpo", "train", "--model", "m"]
    multi = torchrun_args(["train"], {**env, "NNODES": "2", "NODE_RANK": "1", "MASTER_ADDR": "10.0.0.1",
                                      "MASTER_PORT": "29400"}, visible_gpus=4)
    assert " ".join(multi).startswith("--nproc_per_node 4 --max_restarts 0 --nnodes 2 --node_rank 1 "
                                      "--master_addr 10.0.0.1 --master_port 29400")
    with pytest.raises(FastDPOError, match="only 2 GPUs are visible"):
        torchrun_args(["train"], env, visible_gpus=2)
    with pytest.raises(FastDPOError, match="MASTER_ADDR"):
        torchrun_args(["train"], {**env, "NNODES": "2", "NODE_RANK": "1"}, visible_gpus=4)
    with pytest.raises(FastDPOError, match="NPROC_PER_NODE='x'"):
        torchrun_args(["train"], {"NPROC_PER_NODE": "x"}, visible_gpus=0)


def test_failure_message_names_the_rank_that_failed_first():
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    failures = {0: ProcessFailure(0, 100, -signal.SIGTERM, ""), 1: ProcessFailure(1, 101, -signal.SIGKILL, ""),
                2: ProcessFailure(0, 102, 1, "")}
    msg = failure_message(failures)
    assert msg.startswith("training failed: rank 1 (local rank 1, pid 101) was killed by SIGKILL; then rank 2 "
                          "exited with code 1, rank 0 was killed by SIGTERM")


# ---------------------------------------------------------------- DDP on two CPU ranks


@pytest.fixture(scope="module")
def ddp(tmp_path_factory, model_dirs):
    """Two ranks x 2 pairs x 2 micro-steps (checkpoint at step 3) and one rank x 4 pairs x 2 micro-steps."""
    tmp = tmp_path_factory.mktemp("ddp")
    common = dict(model=str(model_dirs("qwen3")), dataset=[str(dataset(tmp))], **BASE)
    run_ranks(2, output_dir=str(tmp / "ws2"), per_device_train_batch_size=2, gradient_accumulation_steps=2,
              save_steps=3, **common)
    one = TrainConfig(output_dir=str(tmp / "ws1"), per_device_train_batch_size=4, gradient_accumulation_steps=2,
                      **common)
    train(one, progress=False)
    return tmp, one


def test_ddp_two_ranks_match_one_rank(ddp):
    tmp, _ = ddp
    assert_weights_close(weights(tmp / "ws2"), weights(tmp / "ws1"), atol=1e-5)
    two, one = metrics(tmp / "ws2"), metrics(tmp / "ws1")
    assert len(two) == 6  # written by rank 0 only
    for x, y in zip(two, one):
        for key in ("loss", "rewards/margins", "rewards/accuracies", "logps/chosen", "grad_norm"):
            assert x[key] == pytest.approx(y[key], rel=1e-5, abs=1e-6), (x["step"], key)
        if x["step"] < 6:  # the last step holds one pair: a single micro-step
            assert x["update_gap"] == y["update_gap"] == 2  # --gradient_accumulation_steps, on 1 rank or 2


def test_two_rank_checkpoint_resumes_on_one_rank(ddp):
    tmp, one = ddp
    ck = tmp / "ws2" / "checkpoint-3"
    assert (ck / "sharded" / ".metadata").is_file()
    assert (ck / "state" / "rng-0.pt").is_file() and (ck / "state" / "rng-1.pt").is_file()
    resumed = TrainConfig(**{**one.to_dict(), "output_dir": str(tmp / "resumed"), "resume_from_checkpoint": str(ck)})
    train(resumed, progress=False)
    assert_weights_close(weights(tmp / "resumed"), weights(tmp / "ws2"), atol=1e-6)
    assert [r["step"] for r in metrics(tmp / "resumed")] == [4, 5, 6]


def test_resume_with_another_step_size_is_refused(ddp):
    tmp, one = ddp
    wrong = TrainConfig(**{**one.to_dict(), "output_dir": str(tmp / "wrong"), "gradient_accumulation_steps": 1,
                           "resume_from_checkpoint": str(tmp / "ws2" / "checkpoint-3")})
    with pytest.raises(FastDPOError, match="8 pairs per optimizer step; this run has 4.*--gradient_accumulation_steps 2"):
        train(wrong, progress=False)


def test_a_signal_to_one_rank_stops_all_after_the_same_step(ddp, model_dirs):
    """SIGTERM to rank 1 only: both ranks finish the step, write one sharded checkpoint together and exit 143 (a
    rank that stopped alone would leave the other waiting in a collective)."""
    tmp, one = ddp
    out = tmp / "stopped"
    procs = start_ranks(2, **{**one.to_dict(), "output_dir": str(out), "per_device_train_batch_size": 2,
                              "max_steps": 100000})
    deadline = time.monotonic() + 120
    while not ((out / "metrics.jsonl").is_file() and (out / "metrics.jsonl").read_text()):
        assert all(p.is_alive() for p in procs) and time.monotonic() < deadline
        time.sleep(0.1)
    os.kill(procs[1].pid, signal.SIGTERM)
    assert join_ranks(procs, timeout=60) == [143, 143]
    saved = [p for p in out.iterdir() if p.name.startswith("checkpoint-")]
    assert len(saved) == 1 and (saved[0] / "sharded" / ".metadata").is_file()
    step = json.loads((saved[0] / "state" / "trainer_state.json").read_text())["step"]
    assert [r["step"] for r in metrics(out)] == list(range(1, step + 1))


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="finds the worker processes through /proc")
def test_killed_rank_ends_the_job_with_a_message(tmp_path, model_dirs):
    """NPROC_PER_NODE=2 fastdpo train ...: SIGKILL rank 1 mid-run; the job exits non-zero, naming rank 1, quickly."""
    out = tmp_path / "out"
    env = {**os.environ, "NPROC_PER_NODE": "2", "PYTHONUNBUFFERED": "1"}
    job = subprocess.Popen([sys.executable, "-m", "fastdpo", "train", "--model", str(model_dirs("qwen3")),
                            "--dataset", str(dataset(tmp_path)), "--output_dir", str(out), "--max_steps", "100000",
                            "--per_device_train_batch_size", "2", "--disable_progress"],
                           env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        while not ((out / "metrics.jsonl").is_file() and (out / "metrics.jsonl").read_text()):  # training runs
            if job.poll() is not None or time.monotonic() > deadline:
                job.kill()  # before reading its output, which would otherwise wait for the job's end
                pytest.fail(f"the job logged no step: {job.communicate()[0]}")
            time.sleep(0.2)
        rank1 = [pid for pid in _children(job.pid) if _environ(pid).get("RANK") == "1"]
        assert len(rank1) == 1
        os.kill(rank1[0], signal.SIGKILL)
        killed = time.monotonic()
        output, _ = job.communicate(timeout=60)
    finally:
        job.kill()
    assert job.returncode != 0
    assert time.monotonic() - killed < 30
    assert f"rank 1 (local rank 1, pid {rank1[0]}) was killed by SIGKILL" in output, output
    assert not (out / "final").exists()


def _children(pid: int) -> list[int]:
    return [int(c) for task in Path(f"/proc/{pid}/task").iterdir() for c in (task / "children").read_text().split()]


def _environ(pid: int) -> dict:
    raw = Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace")
    return dict(kv.split("=", 1) for kv in raw.split("\0") if "=" in kv)


# ---------------------------------------------------------------- the precomputed reference, shared by ranks


def test_each_rank_precomputes_its_share(tmp_path, model_dirs):
    from fastdpo.data.tokenize import TokenizedPair
    from fastdpo.dpo import reference
    from fastdpo.model.backend import choose_backend
    from fastdpo.model.load import load_model, load_tokenizer

    path = str(model_dirs("qwen3"))
    model = load_model(path, torch.float32, torch.device("cpu"))
    backend = choose_backend(model, "auto", True, torch.device("cpu"))
    pairs = [TokenizedPair(prompt=[5, 6, 7], chosen=[8 + i % 5], rejected=[9, 10], index=i) for i in range(7)]
    exchanged = []  # what this rank hands the others: whether it found the cache, then its share of the table
    ranks = reference.Ranks(rank=1, world=3, gather=lambda obj: exchanged.append(obj) or [obj])
    cfg = TrainConfig(model=path, dataset=["x"], precompute_ref_log_probs=True)
    table = reference.precomputed_table(cfg, lambda: (model, backend), pairs, None, load_tokenizer(path).pad_token_id,
                                        ranks=ranks)
    assert exchanged[0] is False and len(exchanged) == 2
    assert sorted(table.index.tolist()) == [1, 4]  # rank 1 of 3: pairs 1, 4
    full = reference.precomputed_table(cfg, lambda: (model, backend), pairs, None, 0)
    torch.testing.assert_close(table.logps[[1, 4]], full.logps[[1, 4]], rtol=1e-6, atol=1e-6)


def test_two_ranks_share_the_precompute_and_match_one_rank(tmp_path, model_dirs):
    from fastdpo.dpo.refcache import load_table

    common = dict(model=str(model_dirs("qwen3")), dataset=[str(dataset(tmp_path))], precompute_ref_log_probs=True,
                  **BASE)
    run_ranks(2, output_dir=str(tmp_path / "ws2"), per_device_train_batch_size=4, ref_cache_dir=str(tmp_path / "c2"),
              **common)
    train(TrainConfig(output_dir=str(tmp_path / "ws1"), per_device_train_batch_size=8,
                      ref_cache_dir=str(tmp_path / "c1"), **common), progress=False)
    assert_weights_close(weights(tmp_path / "ws2"), weights(tmp_path / "ws1"), atol=1e-5)
    (two,), (one,) = list((tmp_path / "c2").rglob("*.safetensors")), list((tmp_path / "c1").rglob("*.safetensors"))
    t2, t1 = load_table(two, "cpu"), load_table(one, "cpu")
    assert t2.logps.shape[0] == t1.logps.shape[0] == 41  # every pair, gathered from both ranks' shares
    torch.testing.assert_close(t2.logps, t1.logps, rtol=1e-5, atol=1e-5)


def test_ddp_gradients_live_in_the_reduction_buckets(model_dirs):
    """No second copy of the gradients: after backward under DDP, each parameter's .grad is a view into one of a
    few bucket buffers, not a tensor of its own."""
    run_isolated(_gradients_in_buckets, str(model_dirs("qwen3")))


def _gradients_in_buckets(model_dir: str) -> None:
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from fastdpo.dpo.reference import Reference
    from fastdpo.model.backend import Backend, build_mask, make_batch, prepare_packed
    from fastdpo.parallel.distributed import Dist
    from fastdpo.parallel.wrap import wrap_models

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    backend = Backend("dense")
    prepare_packed(model, backend)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    policy = wrap_models(model, Reference("precompute"), backend, Dist(0, 1, 0, "ddp"))
    batch = make_batch(random_pairs(3, model.config.vocab_size), backend, 0, torch.device("cpu"))
    for _ in range(2):  # the second backward runs after zero_grad(set_to_none=True), as the loop does
        model.zero_grad(set_to_none=True)
        sums, *_ = policy(batch, build_mask(batch, backend))
        sums.sum().backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    storages = {g.untyped_storage().data_ptr() for g in grads}
    assert len(grads) > 10 and len(storages) < len(grads) / 5


@pytest.mark.parametrize("split", [False, True])
def test_ddp_keeps_each_compiled_layer_one_graph(split, model_dirs):
    """Under DDP, TorchDynamo's DDP optimizer would cut each compiled layer into one graph per reduction bucket;
    compile_layers turns it off, so every layer runs the same single graph. (The `split` case re-enables it, to show
    that this test sees the difference: buckets are made tiny so that even a small model's layers would be cut.)"""
    run_isolated(_one_graph_per_layer, split, str(model_dirs("qwen3")))


def _one_graph_per_layer(split: bool, model_dir: str) -> None:
    import torch._dynamo
    import torch.distributed as dist
    from torch._dynamo.testing import CompileCounter
    from transformers import AutoModelForCausalLM

    from fastdpo.dpo.reference import Reference
    from fastdpo.model.backend import Backend, build_mask, make_batch, prepare_packed
    from fastdpo.model.memory import compile_layers
    from fastdpo.parallel.distributed import Dist
    from fastdpo.parallel.wrap import wrap_models

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    backend = Backend("dense")
    prepare_packed(model, backend)
    graphs = CompileCounter()
    compile_layers(model, backend=graphs)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    with torch._dynamo.config.patch(optimize_ddp=split or torch._dynamo.config.optimize_ddp):
        policy = wrap_models(model, Reference("precompute"), backend, Dist(0, 1, 0, "ddp"))
        policy.bucket_bytes_cap = 1024  # the DDP optimizer reads both when a graph is compiled
        dist._DEFAULT_FIRST_BUCKET_BYTES = 1024  # a child process of its own: nothing to restore
        batch = make_batch(random_pairs(3, model.config.vocab_size), backend, 0, torch.device("cpu"))
        sums, *_ = policy(batch, build_mask(batch, backend))
        sums.sum().backward()
    assert graphs.frame_count > 1 if split else graphs.frame_count == 1


@pytest.mark.parametrize("fsdp", ["", "shard_grad_op"])
def test_compile_warmup_on_two_ranks_matches_one_rank_without_it(fsdp, tmp_path, model_dirs):
    """The warm-up's backward reduces across ranks like any other (DDP all-reduce, FSDP2 reduce-scatter); its
    gradients must be gone before step 1 on every rank."""
    common = dict(model=str(model_dirs("qwen3")), dataset=[str(dataset(tmp_path))], max_tokens_per_batch=256, **BASE)
    run_ranks(2, output_dir=str(tmp_path / "ws2"), per_device_train_batch_size=2, gradient_accumulation_steps=2,
              compile_warmup=True, fsdp=fsdp, **common)
    train(TrainConfig(output_dir=str(tmp_path / "ws1"), per_device_train_batch_size=4, gradient_accumulation_steps=2,
                      **common), progress=False)
    assert_weights_close(weights(tmp_path / "ws2"), weights(tmp_path / "ws1"), atol=1e-5)
    cert = json.loads((tmp_path / "ws2" / "summary.json").read_text())["certificate"]
    checks = {c["name"]: c["status"] for c in cert["checks"]}
    if fsdp:  # sharded weights: the checks are `fastdpo verify`'s, not the run's
        assert set(checks.values()) == {"SKIP"} and "record" not in cert
    else:
        assert set(checks.values()) == {"PASS"} and len(cert["record"]["indices"]) == 2


def test_four_ddp_ranks_match_one_rank(ddp, tmp_path, model_dirs):
    """Four ranks of one pair per micro-step (the last step's single pair leaves three ranks with zero-weight
    micro-steps): one rank's weights and metrics."""
    tmp, one = ddp
    common = dict(model=one.model, dataset=one.dataset, **BASE)
    run_ranks(4, timeout=240, output_dir=str(tmp_path / "ws4"), per_device_train_batch_size=1,
              gradient_accumulation_steps=2, **common)
    assert_weights_close(weights(tmp_path / "ws4"), weights(tmp / "ws1"), atol=1e-5)
    for x, y in zip(metrics(tmp_path / "ws4"), metrics(tmp / "ws1"), strict=True):
        for key in ("loss", "rewards/margins", "rewards/accuracies", "grad_norm"):
            assert x[key] == pytest.approx(y[key], rel=1e-5, abs=1e-6), (x["step"], key)


def test_master_port_flag_is_the_launchers_port(monkeypatch, caplog):
    """DeepSpeed's and torchrun's --master_port on a `NPROC_PER_NODE=N fastdpo train` command sets the workers'
    rendezvous port, as MASTER_PORT does; against a different MASTER_PORT it is refused; without workers it is
    noted and ignored."""
    import logging

    from fastdpo.cli import build_parser
    from fastdpo.config import build_config

    def build(*flags):
        args = build_parser().parse_args(["train", "--model", "m", "--dataset", "d.jsonl", *flags])
        return build_config(args, TrainConfig)

    monkeypatch.delenv("MASTER_PORT", raising=False)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.delenv("NPROC_PER_NODE", raising=False)
    with caplog.at_level(logging.INFO, logger="fastdpo"):
        build("--master_port", "29501")
    assert "MASTER_PORT" not in os.environ and "one process has no rendezvous" in caplog.text
    monkeypatch.setenv("NPROC_PER_NODE", "2")
    build("--master_port", "29501")
    args = torchrun_args(["train"], dict(os.environ), visible_gpus=2)
    assert "--standalone" not in args and args[args.index("--master_port") + 1] == "29501"
    monkeypatch.setenv("MASTER_PORT", "29400")
    with pytest.raises(FastDPOError, match="--master_port 29501 but MASTER_PORT=29400"):
        build("--master_port", "29501")
    with pytest.raises(FastDPOError, match="port number"):
        build("--master_port", "70000")


# ---------------------------------------------------------------- launch-time validation


@pytest.fixture
def launcher(monkeypatch, restore_logging):
    """`NPROC_PER_NODE=N fastdpo train ...` with torchrun's start of the workers replaced by a recorder: each call
    records the environment the workers would inherit and runs `workers(env)` in it."""
    import torch.distributed.run

    for name in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "NNODES", "MASTER_PORT", "FASTDPO_LAUNCHED"):
        monkeypatch.delenv(name, raising=False)
    spawned: list[dict] = []

    def run(args):
        spawned.append(dict(os.environ))
        for hook in launcher_hooks:
            hook(dict(os.environ))

    launcher_hooks: list = []
    monkeypatch.setattr(torch.distributed.run, "run", run)
    return spawned, launcher_hooks


def test_world_size_flags_fail_before_any_worker_starts(launcher, monkeypatch, capsys, tmp_path):
    """ms-swift's --ulysses_num_heads 8 on 2 processes fails in the launcher, naming the flag as typed; a Ulysses
    size that does not divide a local model's heads too; a command that fits starts the workers."""
    spawned, _ = launcher
    monkeypatch.setenv("NPROC_PER_NODE", "2")
    train = ["train", "--model", "m", "--dataset", "d.jsonl"]
    assert main([*train, "--ulysses_num_heads", "8"]) == 1
    out = " ".join(capsys.readouterr().out.split())
    assert "--ulysses_num_heads 8 asks for groups of 8 ranks" in out and "NPROC_PER_NODE=2 starts 2" in out
    assert "--sequence_parallel_size" not in out and "[rank" not in out and not spawned
    monkeypatch.setenv("NPROC_PER_NODE", "4")
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "qwen3", "num_attention_heads": 6}))
    assert main(["train", "--model", str(model), "--dataset", "d.jsonl", "--ulysses_num_heads", "4"]) == 1
    out = " ".join(capsys.readouterr().out.split())
    assert "--ulysses_num_heads 4 splits the 6 attention heads" in out and not spawned
    assert main(["train", "--model", str(model), "--dataset", "d.jsonl", "--sequence_parallel_size", "4",
                 "--sequence_parallel_mode", "ulysses"]) == 1
    assert "--sequence_parallel_size 4 with --sequence_parallel_mode ulysses splits" in capsys.readouterr().out
    (model / "config.json").write_text(json.dumps({"model_type": "qwen3", "num_attention_heads": 8}))
    assert main(["train", "--model", str(model), "--dataset", "d.jsonl", "--ulysses_num_heads", "4"]) == 0
    assert len(spawned) == 1


def test_world_size_flags_from_yaml_are_named_with_their_file(tmp_path):
    y = tmp_path / "run.yaml"
    y.write_text("model: m\ndataset: [d.jsonl]\nulysses_num_heads: 4\n")
    args = build_parser().parse_args(["train", "--config", str(y)])
    cfg = build_config(args, TrainConfig)
    with pytest.raises(FastDPOError, match=rf"--ulysses_num_heads 4 \(in {y}\) asks for groups of 4 .* this run has 6"):
        check_world(cfg, 6, typed_flags(args, WORLD_FIELDS))
    check_world(cfg, 8, typed_flags(args, WORLD_FIELDS))


def test_flag_notes_print_once_per_launch(launcher, monkeypatch, capsys):
    """The notes about other tools' flags print in the launcher; the workers it starts (rank 0 too) print none, and
    under plain torchrun only rank 0 prints them."""
    spawned, hooks = launcher
    argv = ["train", "--model", "m", "--dataset", "d.jsonl", "--rlhf_type", "dpo", "--ulysses_num_heads", "2"]
    note = "ms-swift's meaning for what the command leaves out"

    def workers(env):
        for rank in ("0", "1"):
            monkeypatch.setenv("RANK", rank)
            monkeypatch.setenv("LOCAL_RANK", rank)
            monkeypatch.setenv("WORLD_SIZE", "2")
            build_config(build_parser().parse_args(argv), TrainConfig)

    hooks.append(workers)
    monkeypatch.setenv("NPROC_PER_NODE", "2")
    assert main(argv) == 0 and len(spawned) == 1 and spawned[0]["FASTDPO_LAUNCHED"] == "1"
    assert capsys.readouterr().out.count(note) == 1
    assert "FASTDPO_LAUNCHED" not in os.environ  # set for the workers only: the caller's later notes still print
    workers({})  # torchrun -m fastdpo train ...: rank 0 speaks for the job
    assert capsys.readouterr().out.count(note) == 1


# ---------------------------------------------------------------- KTO on two ranks


def test_kto_two_ranks_take_trl_rounds(tmp_path, model_dirs):
    """Two ranks of KTO: micro-step m runs the step's chunk 2m on rank 0 and 2m+1 on rank 1 (TRL's sequential
    batches dealt to ranks), the round's KL estimate is the clamped mean of the two chunks' means, and the step's
    loss is the mean over chunks of each chunk's mean row loss: the first step's logged loss, kl and rewards equal a
    plain float32 computation (one unpacked forward per sequence, full logits)."""
    from transformers import AutoModelForCausalLM

    from fastdpo.data.formats import Row
    from fastdpo.data.kto import kl_completions
    from fastdpo.data.tokenize import TokenizeOptions, tokenize_rows
    from fastdpo.model.load import load_tokenizer
    from fastdpo.model.tiny import build_tiny_model

    rows = [{"prompt": f"w{10 + i} w{30 + i % 3}", "completion": " w5 w6" if i % 3 else " w7 w8 w9",
             "label": i % 3 != 1} for i in range(16)]
    data = write_jsonl(tmp_path / "kto.jsonl", rows)
    # these two random models give a positive raw KL estimate (the other way round both rounds clamp at 0)
    policy = build_tiny_model(tmp_path / "policy", "qwen3", seed=1)
    ref = model_dirs("qwen3")
    b, g, beta = 2, 2, 0.1
    run_ranks(2, output_dir=str(tmp_path / "ws2"), model=str(policy), ref_model=str(ref), dataset=[str(data)],
              loss_type="kto", per_device_train_batch_size=b, gradient_accumulation_steps=g, max_steps=1,
              logging_steps=1, learning_rate=1e-3, disable_progress=True)
    logged = metrics(tmp_path / "ws2")[0]
    cert = json.loads((tmp_path / "ws2" / "summary.json").read_text())["certificate"]
    assert [(c["name"], c["status"]) for c in cert["checks"]] == [  # each rank checked its own first chunk
        ("fast_path", "PASS"), ("head_float32", "PASS"), ("reference_at_start", "SKIP"), ("reference_apart", "PASS")]

    tok = load_tokenizer(str(policy))
    read = [Row(r["prompt"], r["completion"], r["completion"], f"d:{i}", label=r["label"]) for i, r in enumerate(rows)]
    pairs = kl_completions(tokenize_rows(tok, read, options=TokenizeOptions())[0], b, 2048)[: b * g * 2]
    models = [AutoModelForCausalLM.from_pretrained(m, dtype=torch.float32) for m in (policy, ref)]

    def logp(model, prompt, completion):
        ids = torch.tensor([prompt + completion])
        with torch.no_grad():
            lp = torch.log_softmax(model(ids).logits.float()[0, :-1], -1)
        at = torch.arange(len(prompt) - 1, len(ids[0]) - 1)
        return float(lp[at, ids[0, at + 1]].sum())

    lr = [logp(models[0], p.prompt, p.chosen) - logp(models[1], p.prompt, p.chosen) for p in pairs]
    d = [logp(models[0], p.prompt, p.rejected) - logp(models[1], p.prompt, p.rejected) for p in pairs]
    sig = lambda z: 1 / (1 + math.exp(-z))
    losses, kls, chosen, rejected = [], [], [], []
    for m in range(g):  # round m: chunks 2m and 2m+1, on ranks 0 and 1
        rows_m = range(2 * m * b, 2 * (m + 1) * b)
        z = max(0.0, (sum(d[i] for i in rows_m[:b]) / b + sum(d[i] for i in rows_m[b:]) / b) / 2)
        kls.append(z)
        for c in (rows_m[:b], rows_m[b:]):
            losses.append(sum(1 - sig(beta * (lr[i] - z)) if pairs[i].label else 1 - sig(beta * (z - lr[i]))
                              for i in c) / b)
        good = [beta * lr[i] for i in rows_m if pairs[i].label]
        bad = [beta * lr[i] for i in rows_m if not pairs[i].label]
        if good:
            chosen.append(sum(good) / len(good))
        if bad:
            rejected.append(sum(bad) / len(bad))
    assert logged["loss"] == pytest.approx(sum(losses) / len(losses), rel=1e-4)
    assert logged["kl"] == pytest.approx(sum(kls) / len(kls), rel=1e-4, abs=1e-7) and logged["kl"] > 0
    # rewards are beta x differences of log-prob sums: float32 sums carry ~1e-6 of absolute error
    assert logged["rewards/chosen"] == pytest.approx(sum(chosen) / len(chosen), rel=1e-4, abs=1e-6)
    assert logged["rewards/rejected"] == pytest.approx(sum(rejected) / len(rejected), rel=1e-4, abs=1e-6)
    assert logged["rewards/chosen"] != pytest.approx(logged["rewards/rejected"], abs=1e-6)
