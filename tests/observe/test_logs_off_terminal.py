"""Training logs off a terminal (nohup, CI, `> train.log`): one line per step at any width with the time left on
each, log records unwrapped, the run's own rate, and an end-of-run summary printed and saved as summary.json."""

import json
import os
import re
import subprocess
import sys

from data_helpers import easy_rows, write_jsonl

from fastdpo.observe import progress as progress_mod
from fastdpo.observe.progress import RunProgress, clock, run_summary, summary_line

STEP_LINE = re.compile(r"^step +\d+/6  loss=\S+ .* eta=\d+:\d\d:\d\d$")


def test_train_log_in_a_file_has_one_line_per_step_and_a_summary(tmp_path, model_dirs):
    # a long output dir: the logged paths pass 80 columns
    out = tmp_path / ("a-long-output-directory-name-" * 3) / "run"
    data = write_jsonl(tmp_path / "d.jsonl", easy_rows(24))
    log = tmp_path / "train.log"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": "80"}
    env.pop("FORCE_COLOR", None)
    with open(log, "w") as f:  # stdout is a file, as with nohup or `> train.log`
        res = subprocess.run([sys.executable, "-m", "fastdpo", "train", "--model", str(model_dirs()), "--dataset",
                              str(data), "--output_dir", str(out), "--max_steps", "6", "--per_device_train_batch_size",
                              "4", "--learning_rate", "1e-3"], stdout=f, stderr=subprocess.STDOUT, env=env,
                             timeout=300)
    text = log.read_text()
    assert res.returncode == 0, text
    lines = text.splitlines()
    steps = [ln for ln in lines if ln.startswith("step ")]
    assert len(steps) == 6 and all(STEP_LINE.match(ln) for ln in steps), text
    assert any(len(ln) > 100 for ln in lines)  # nothing is cut at 80 columns ...
    assert not any(ln.startswith(" " * 8) for ln in lines), text  # ... nor continued on the next line
    assert all(len(ln) == len(ln.rstrip()) for ln in lines)  # nor padded to a width
    training = next(ln for ln in lines if "Training: {" in ln)
    assert training.startswith("INFO     Training: {") and training.endswith("}")
    assert "━" not in text  # no bar printed once at the end
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 6 and summary["pairs"] == 24 and summary["train_runtime"] > 0
    assert summary["train_samples_per_second"] > 0 and summary["tokens_per_second"] > 0
    assert summary["peak_memory_gib"] is None and "loss" in summary["final_metrics"]
    line = next(ln for ln in lines if "run summary: 6 steps in" in ln)
    assert "pairs/s" in line and "final loss=" in line and "summary.json" in line
    assert f"peak RSS {summary['peak_rss_gib']:.2f} GiB" in line  # a CPU run's memory figure


def test_the_rate_is_the_runs_not_the_last_windows(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(progress_mod.time, "perf_counter", lambda: now[0])
    p = RunProgress(total=10, start=2)
    for pairs, seconds in ((8, 1.0), (8, 1.0), (8, 6.0)):  # a slow last step
        now[0] += seconds
        p.advance(p.done + 1, pairs, 100 * pairs)
    assert p.rate()["pairs_per_second"] == 24 / 8.0 and p.rate()["tokens_per_second"] == 2400 / 8.0
    assert p.eta() == 8.0 / 3 * 5 and p.eta(2) is None
    s = run_summary(p, {"step": 5, "loss": 0.5, "rewards/margins": 1.25}, None)
    assert (s["steps"], s["first_step"], s["train_samples_per_second"]) == (3, 3, 3.0)
    assert summary_line(s) == ("run summary: 3 steps in 0:00:08 (8.0 s)  3.00 pairs/s  300 tokens/s  peak memory n/a"
                               "  final loss=0.5  margins=1.25")
    assert clock(3723.4) == "1:02:03" and clock(None) == "?"


def test_console_off_a_terminal_never_wraps(capsys):
    from fastdpo.cli import _console

    console = _console()
    assert not console.is_terminal
    console.print("x" * 200, highlight=False)
    assert capsys.readouterr().out == "x" * 200 + "\n"


def test_demo_prints_its_equivalent_command_on_one_line(tmp_path, monkeypatch):
    import io

    from rich.console import Console

    import fastdpo.training.loop as loop
    from fastdpo.commands import demo

    monkeypatch.setattr(demo, "greedy_eval", lambda model_dir, heldout: ["" for _ in heldout])
    monkeypatch.setattr(loop, "train", lambda cfg, console=None, progress=True: {"final_dir": None, "stopped": "test"})
    buf = io.StringIO()
    demo.run_demo(str(tmp_path / "demo"), console=Console(file=buf, width=60, force_terminal=True), quick=True)
    line = next(ln for ln in buf.getvalue().splitlines() if "command" in ln)
    assert line.lstrip().startswith("command   fastdpo train --model ") and line.endswith("--plot True"), line


def test_steps_that_build_kernels_say_so(tmp_path, model_dirs, monkeypatch, caplog):
    """With --torch_compile the run says up front that the first step builds kernels, and a step that compiled a
    graph is named with its time (a later one as meeting a new micro-batch shape)."""
    import logging

    import torch._dynamo

    from fastdpo.config import TrainConfig
    from fastdpo.model import memory
    from fastdpo.parallel import parallelize as par
    from fastdpo.training.loop import train

    monkeypatch.setattr(par, "compile_layers", lambda model, **kw: memory.compile_layers(model, "eager", **kw))
    torch._dynamo.reset()
    data = write_jsonl(tmp_path / "d.jsonl", easy_rows(12))
    cfg = TrainConfig(model=str(model_dirs()), dataset=[str(data)], output_dir=str(tmp_path / "run"), max_steps=3,
                      per_device_train_batch_size=4, torch_compile=True, device="cpu", disable_progress=True)
    with caplog.at_level(logging.INFO, logger="fastdpo"):
        train(cfg, progress=False)
    text = caplog.text
    assert "Building kernels: the first step compiles the decoder layers (--torch_compile)" in text
    assert re.search(r"Step 1 built kernels \(\d+ compiled graphs?\) in \d+\.\d s\.", text), text


def test_progress_bar_shows_building_until_the_first_step():
    from rich.console import Console as Rich

    bar = RunProgress(3, console=Rich(file=open(os.devnull, "w"), force_terminal=True))
    try:
        bar.building()
        assert bar.bar.tasks[0].fields["rate"] == "building kernels"
        bar.advance(1, 8, 100)
        assert bar.bar.tasks[0].fields["rate"].endswith("pairs/s")
    finally:
        bar.stop()
