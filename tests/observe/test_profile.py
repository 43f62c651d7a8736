"""--profile_steps: interval arithmetic of the breakdown, and a profiled CPU run writing its trace and summary."""

import gzip
import json

import pytest

from fastdpo.errors import FastDPOError
from fastdpo.observe.profile import breakdown, merge, parse_steps, subtract


def test_parse_steps():
    assert parse_steps("") is None
    assert parse_steps("6-8") == (6, 8)
    assert parse_steps("7") == (7, 7)
    for bad in ("0", "8-6", "a-b", "-2"):
        with pytest.raises(FastDPOError, match="--profile_steps"):
            parse_steps(bad)


def test_interval_union_and_difference():
    assert merge([(5, 7), (0, 2), (1, 3), (7, 8)]) == [(0, 3), (5, 8)]
    a = merge([(0, 10), (20, 30)])
    b = merge([(2, 4), (8, 22), (25, 26)])
    assert subtract(a, b) == [(0, 2), (4, 8), (22, 25), (26, 30)]
    assert subtract(a, []) == a
    assert subtract(a, [(-5, 40)]) == []


def test_breakdown_separates_hidden_and_exposed_communication():
    # µs: compute 0-400 and 600-800; NCCL 300-700 (hidden 300-400 and 600-700, exposed 400-600); wall 1 ms
    events = [("gemm", 0, 400), ("gemm", 600, 200), ("ncclDevKernel_AllGather", 300, 400)]
    b = breakdown(events, steps=1, wall_s=1e-3)
    assert b.compute_s == pytest.approx(600e-6)
    assert b.comm_s == pytest.approx(400e-6)
    assert b.exposed_comm_s == pytest.approx(200e-6)
    assert b.idle_s == pytest.approx(200e-6)
    assert b.top_kernels[0] == ["gemm", 0.0006]
    assert "exposed communication 20%" in b.line() and "idle 20%" in b.line()


def test_device_events_leave_out_cpu_ops_and_annotations():
    from types import SimpleNamespace

    import torch

    from fastdpo.observe.profile import device_events

    def event(name, device, start, end, annotation=False):
        return SimpleNamespace(name=name, device_type=device, time_range=SimpleNamespace(start=start, end=end),
                               is_user_annotation=annotation)

    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU
    prof = SimpleNamespace(events=lambda: [event("aten::mm", cpu, 0, 5), event("gemm", cuda, 1, 4),
                                           event("DistributedDataParallel.forward", cuda, 0, 100, annotation=True)])
    assert device_events(prof) == [("gemm", 1.0, 3.0)]


def test_profiled_run_writes_trace_and_summary(tmp_path, model_dirs):
    from data_helpers import easy_rows, write_jsonl

    from fastdpo.config import TrainConfig
    from fastdpo.training.loop import train

    data = write_jsonl(tmp_path / "d.jsonl", easy_rows(16, seed=1))
    cfg = TrainConfig(
        model=str(model_dirs("qwen3")),
        dataset=[str(data)],
        output_dir=str(tmp_path / "run"),
        max_steps=4,
        profile_steps="2-3",
        disable_progress=True,
    )
    train(cfg, progress=False)
    prof = tmp_path / "run/profile/rank0"
    summary = json.loads((prof / "summary.json").read_text())
    assert summary["breakdown"]["steps"] == 2 and summary["breakdown"]["wall_s"] > 0
    assert "no device kernels recorded" in summary["line"]
    assert (prof / "top.txt").read_text().split()[:2] == ["self", "ms/step"]
    trace = json.loads(gzip.decompress((prof / "trace.json.gz").read_bytes()))
    names = {e.get("name", "") for e in trace["traceEvents"]}
    assert any(n.startswith("aten::") for n in names)  # the steps' ops were recorded
    # the loop's phases are named (benchmarks/trace_gaps.py splits device time by them)
    assert {f"fastdpo.{p}" for p in ("pack", "forward", "loss", "backward", "metrics", "clip", "update")} <= names
    with pytest.raises(FastDPOError, match="--profile_steps"):
        TrainConfig(model="m", dataset=["d"], profile_steps="x").validate()


def test_a_window_outside_the_run_is_named(tmp_path, model_dirs, caplog):
    from data_helpers import easy_rows, write_jsonl

    from fastdpo.config import TrainConfig
    from fastdpo.training.loop import train

    data = write_jsonl(tmp_path / "d.jsonl", easy_rows(8, seed=1))
    cfg = TrainConfig(model=str(model_dirs("qwen3")), dataset=[str(data)], output_dir=str(tmp_path / "run"),
                      max_steps=2, profile_steps="3-4", disable_progress=True)
    with caplog.at_level("WARNING", logger="fastdpo"):
        train(cfg, progress=False)
    assert "this run trains steps 1-2" in caplog.text
    assert not (tmp_path / "run/profile").exists()


def test_memory_peak_names_what_was_alive_at_it():
    """The replay follows alloc / free_completed (not free_requested: the block may still be in use on another
    stream), finds the peak, and groups the allocations alive at it by the first frame outside torch."""
    from fastdpo.observe.memtrace import NO_FRAME, format_report, peak_report, site

    ours = [{"filename": "/x/torch/nn/functional.py", "line": 9, "name": "linear"},
            {"filename": "/x/fastdpo/distributed.py", "line": 310, "name": "_sum_in_fp32"}]
    model = [{"filename": "/x/transformers/models/qwen3/modeling_qwen3.py", "line": 60, "name": "forward"}]
    events = [
        {"action": "alloc", "addr": 1, "size": 100, "frames": ours},
        {"action": "alloc", "addr": 2, "size": 50, "frames": model},
        {"action": "free_requested", "addr": 1, "size": 100},
        {"action": "alloc", "addr": 3, "size": 30, "frames": []},  # still 100 + 50 + 30: addr 1 not yet free
        {"action": "free_completed", "addr": 1, "size": 100},
        {"action": "free_completed", "addr": 99, "size": 7},  # allocated before the recording began: ignored
        {"action": "alloc", "addr": 4, "size": 60, "frames": ours},
        {"action": "free_completed", "addr": 2, "size": 50},
    ]
    r = peak_report(events, baseline=1000)
    assert (r["peak_bytes"], r["window_bytes_at_peak"]) == (1180, 180)
    assert [(s["site"], s["bytes"]) for s in r["sites"]] == [
        ("/x/fastdpo/distributed.py:310 _sum_in_fp32", 100),
        ("/x/transformers/models/qwen3/modeling_qwen3.py:60 forward", 50), (NO_FRAME, 30)]
    assert site([{"filename": "/tmp/torchinductor_u/ab/cabc.py", "line": 3, "name": "call"}]).startswith("/tmp/torch")
    assert format_report(r).count("\n") == 3 and "before it began" in format_report(r)  # header + three sites
    top1 = peak_report(events, baseline=0, top=1)
    assert top1["other_bytes"] == 80


def test_profile_memory_needs_a_window_and_says_when_it_cannot_record(tmp_path, model_dirs, caplog):
    from data_helpers import easy_rows, write_jsonl

    from fastdpo.config import TrainConfig
    from fastdpo.training.loop import train

    with pytest.raises(FastDPOError, match="--profile_steps"):
        TrainConfig(model="m", dataset=["d"], profile_memory=True).validate()
    data = write_jsonl(tmp_path / "d.jsonl", easy_rows(8, seed=1))
    cfg = TrainConfig(model=str(model_dirs("qwen3")), dataset=[str(data)], output_dir=str(tmp_path / "run"),
                      max_steps=2, profile_steps="2", profile_memory=True, disable_progress=True)
    with caplog.at_level("WARNING", logger="fastdpo"):
        train(cfg, progress=False)
    assert "records CUDA allocations" in caplog.text
    assert (tmp_path / "run/profile/rank0/summary.json").is_file()  # the time profile still ran
    assert not (tmp_path / "run/profile/rank0/memory.txt").exists()
