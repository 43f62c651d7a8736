"""A run owns its --output_dir: a second run into it is refused naming the first, a stale lock of a dead process is
taken over, a fresh run into an earlier run's outputs is refused unless --overwrite_output_dir true."""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from data_helpers import easy_rows, write_jsonl

from fastdpo import checkpoint as ckpt
from fastdpo.checkpoint import lock, outputs, ownership
from fastdpo.config import TrainConfig
from fastdpo.errors import FastDPOError
from fastdpo.parallel.distributed import Dist
from fastdpo.training.loop import train

BASE = dict(learning_rate=1e-3, per_device_train_batch_size=2, gradient_accumulation_steps=2, seed=3, device="cpu")

pytestmark = pytest.mark.usefixtures("one_thread")


def config(root: Path, model: Path, name: str, **kw) -> TrainConfig:
    data = root / "data.jsonl"
    if not data.exists():
        write_jsonl(data, easy_rows(48, seed=1))
    return TrainConfig(**{"model": str(model), "dataset": [str(data)], "output_dir": str(root / name), **BASE, **kw})


@pytest.fixture(scope="module")
def finished(tmp_path_factory, model_dirs):
    """A finished 4-step run that kept checkpoint-2 and checkpoint-4; copy it before changing it."""
    root = tmp_path_factory.mktemp("finished")
    cfg = config(root, model_dirs("qwen3"), "run", max_steps=4, save_steps=2)
    train(cfg, progress=False)
    return cfg


def copy_run(cfg: TrainConfig, tmp_path: Path, **changes) -> TrainConfig:
    out = tmp_path / "run"
    shutil.copytree(cfg.output_dir, out)
    return TrainConfig(**{**cfg.to_dict(), "output_dir": str(out), **changes})


def contents(out: Path) -> dict:
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


# ---------------------------------------------------------------- two runs at once


def test_a_second_run_into_a_held_dir_is_refused_and_the_first_finishes_intact(tmp_path, model_dirs):
    m = model_dirs("qwen3")
    cfg = config(tmp_path, m, "run", max_steps=24, save_steps=4)
    argv = [sys.executable, "-m", "fastdpo", "train", "--model", str(m), "--dataset", cfg.dataset[0], "--output_dir",
            cfg.output_dir, "--max_steps", "24", "--save_steps", "4", "--disable_progress", "true"]
    for k, v in BASE.items():
        argv += [f"--{k}", str(v)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    first = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    out = Path(cfg.output_dir)
    try:
        end = time.monotonic() + 300
        while not (out / "metrics.jsonl").is_file() or not (out / "metrics.jsonl").read_text().count("\n"):
            assert first.poll() is None and time.monotonic() < end, first.communicate()[0][-3000:]
            time.sleep(0.01)
        for resume in ("", "latest"):  # neither a fresh run nor a resume may write there now
            with pytest.raises(FastDPOError) as e:
                train(TrainConfig(**{**cfg.to_dict(), "resume_from_checkpoint": resume}), progress=False)
            msg = str(e.value)
            assert "is in use by another run" in msg and f"pid {first.pid} on {socket.gethostname()}" in msg, msg
            assert "running `python -m fastdpo train --model" in msg and "started 20" in msg, msg
        output = first.communicate(timeout=300)[0]
    finally:
        first.kill()
    assert first.returncode == 0, output[-3000:]
    logged = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert logged == list(range(1, 25))
    assert [p.name for p in ckpt.complete_checkpoints(out)] == [f"checkpoint-{n}" for n in (4, 8, 12, 16, 20, 24)]
    assert all(ckpt.checkpoint_problem(p) is None for p in ckpt.complete_checkpoints(out))
    assert (out / "final" / "model.safetensors").is_file()
    assert not (out / lock.LOCK).exists()  # released at the end


def test_a_lock_record_of_a_live_process_is_refused_naming_it(tmp_path, model_dirs):
    """A holder that is alive (here a process that holds no flock, as on a filesystem without one) keeps the dir."""
    cfg = config(tmp_path, model_dirs("qwen3"), "run", max_steps=2)
    out = Path(cfg.output_dir)
    out.mkdir()
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        holder = lock.Holder(sleeper.pid, socket.gethostname(), "2030-01-02 03:04:05 +0000", "fastdpo train x",
                                  lock._proc_start(sleeper.pid))
        (out / lock.LOCK).write_text(json.dumps(holder.__dict__))
        with pytest.raises(FastDPOError, match=rf"in use by another run: pid {sleeper.pid} on .*started 2030-01-02 "
                                               r"03:04:05 \+0000, running `fastdpo train x`"):
            train(cfg, progress=False)
    finally:
        sleeper.kill()
        sleeper.wait()
    assert not (out / "metrics.jsonl").exists()  # stopped before training


def test_a_stale_lock_of_a_dead_process_is_taken_over_with_a_note(tmp_path, model_dirs, caplog):
    cfg = config(tmp_path, model_dirs("qwen3"), "run", max_steps=2)
    out = Path(cfg.output_dir)
    out.mkdir()
    pid = dead_pid()
    (out / lock.LOCK).write_text(json.dumps({"pid": pid, "host": socket.gethostname(), "started": "yesterday",
                                                  "command": "fastdpo train killed", "proc_start": 1}))
    with caplog.at_level("WARNING", logger="fastdpo"):
        assert train(cfg, progress=False)["final_dir"]
    assert f"took over the lock of a run that is no longer running (pid {pid}" in caplog.text
    assert not (out / lock.LOCK).exists()


def test_a_reused_pid_is_not_mistaken_for_the_holder():
    """The record keeps the holder's start time: a live process that got the same pid later is not the holder."""
    me = lock.Holder.this_process()
    assert me.alive() is True
    assert lock.Holder(me.pid, me.host, me.started, me.command, (me.proc_start or 0) + 1).alive() is (
        me.proc_start is None)
    assert lock.Holder(dead_pid(), me.host, "", "").alive() is False
    assert lock.Holder(me.pid, "another-host.example", "", "").alive() is None


def test_the_lock_is_released_on_an_error_and_on_sigterm(tmp_path, model_dirs):
    cfg = config(tmp_path, model_dirs("qwen3"), "run", max_steps=2, dataset=[str(tmp_path / "missing.jsonl")])
    with pytest.raises(FastDPOError, match="not found"):
        train(cfg, progress=False)
    out = Path(cfg.output_dir)
    assert not out.exists()  # a failed start leaves no dir behind
    out.mkdir()

    before = signal.getsignal(signal.SIGTERM)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        with pytest.raises(SystemExit) as e:
            with ownership.own_output_dir(cfg, Dist()):
                assert (out / lock.LOCK).is_file()
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(1)
        assert e.value.code == 128 + signal.SIGTERM
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
    finally:
        signal.signal(signal.SIGTERM, before)
    assert not (out / lock.LOCK).exists()


def test_one_process_cannot_hold_a_dir_twice(tmp_path):
    cfg = TrainConfig(model="m", dataset=["d"], output_dir=str(tmp_path / "run"))
    with ownership.own_output_dir(cfg, Dist()):
        with pytest.raises(FastDPOError, match=f"in use by another run: pid {os.getpid()}"):
            with ownership.own_output_dir(cfg, Dist()):
                pass
        assert (tmp_path / "run" / lock.LOCK).is_file()
    with ownership.own_output_dir(cfg, Dist()):
        pass


# ---------------------------------------------------------------- an earlier run's outputs


def test_a_fresh_run_into_a_finished_runs_dir_is_refused_with_the_choices(finished, tmp_path):
    cfg = copy_run(finished, tmp_path)
    out = Path(cfg.output_dir)
    before = contents(out)
    with pytest.raises(FastDPOError) as e:
        train(cfg, progress=False)
    msg = str(e.value)
    assert "holds the outputs of an earlier run (checkpoint-2, checkpoint-4, final/, metrics.jsonl (4 logged steps))" in msg, msg
    for choice in ("--resume_from_checkpoint latest", "another --output_dir", "--overwrite_output_dir true"):
        assert choice in msg, msg
    assert contents(out) == before  # nothing touched


def test_a_fresh_run_into_a_dir_with_only_a_metrics_log_is_refused(finished, tmp_path):
    """A finished run without checkpoints: before, it was replaced without a word."""
    cfg = copy_run(finished, tmp_path)
    out = Path(cfg.output_dir)
    for name in ("checkpoint-2", "checkpoint-4", "final"):
        shutil.rmtree(out / name)
    with pytest.raises(FastDPOError, match=r"earlier run \(metrics.jsonl \(4 logged steps\)\)"):
        train(cfg, progress=False)


def test_latest_into_a_finished_run_without_checkpoints_is_refused(finished, tmp_path):
    cfg = copy_run(finished, tmp_path, resume_from_checkpoint="latest")
    for name in ("checkpoint-2", "checkpoint-4"):
        shutil.rmtree(Path(cfg.output_dir) / name)
    with pytest.raises(FastDPOError, match="holds a finished run .* but no checkpoint to continue from"):
        train(cfg, progress=False)


def test_overwrite_output_dir_removes_the_earlier_outputs_and_says_so(finished, tmp_path, caplog):
    cfg = copy_run(finished, tmp_path, overwrite_output_dir=True, max_steps=2, save_steps=1)
    out = Path(cfg.output_dir)
    (out / "notes.txt").write_text("mine")  # not a training output: kept
    (out / "profile").mkdir()  # a name a run writes (--profile_steps), but this run's dir is the user's: kept
    (out / "profile" / "trace.json").write_text("mine")
    with caplog.at_level("WARNING", logger="fastdpo"):
        train(cfg, progress=False)
    assert "--overwrite_output_dir: removed the earlier run's outputs" in caplog.text
    assert "checkpoint-2, checkpoint-4, final, metrics.jsonl" in caplog.text
    # only this run's outputs: a later `latest` cannot pick up the old run's checkpoint-4
    assert [p.name for p in ckpt.complete_checkpoints(out)] == ["checkpoint-1", "checkpoint-2"]
    assert [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    assert (out / "notes.txt").read_text() == "mine"
    assert (out / "profile" / "trace.json").read_text() == "mine"
    assert [p.name for p in out.iterdir() if p.name.startswith(".")] == [outputs.RECORD]  # no leftovers


def test_a_resume_is_not_refused_for_the_outputs_it_continues(finished, tmp_path):
    cfg = copy_run(finished, tmp_path, resume_from_checkpoint="latest", max_steps=6)
    assert train(cfg, progress=False)["final_dir"]
    steps = [json.loads(line)["step"] for line in (Path(cfg.output_dir) / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 7))


def test_llamafactory_overwrite_output_dir_is_the_flag(tmp_path):
    from fastdpo.cli import build_parser
    from fastdpo.config import build_config

    y = tmp_path / "lf.yaml"
    y.write_text("model_name_or_path: m\nstage: dpo\ndataset: d.jsonl\noverwrite_output_dir: true\n")
    assert build_config(build_parser().parse_args(["train", "--config", str(y)]), TrainConfig).overwrite_output_dir
    assert not TrainConfig().overwrite_output_dir


def test_the_demo_replaces_only_its_own_dir(tmp_path, finished):
    from fastdpo.commands.demo import _demo_dir

    assert _demo_dir(tmp_path / "new")
    (tmp_path / "demo").mkdir()
    (tmp_path / "demo" / "demo_result.json").write_text("{}")
    assert _demo_dir(tmp_path / "demo")
    assert not _demo_dir(Path(finished.output_dir))  # a training run's dir is refused as for any run


# ---------------------------------------------------------------- files of the user's own


def test_a_fresh_run_never_writes_over_files_of_your_own(tmp_path, model_dirs):
    cfg = config(tmp_path, model_dirs("qwen3"), "run", max_steps=2)
    out = Path(cfg.output_dir)
    out.mkdir()
    (out / "config.yaml").write_text("model: mine\n")
    (out / "summary.json").write_text("{}")
    before = contents(out)
    for overwrite in (False, True):
        with pytest.raises(FastDPOError) as e:
            train(TrainConfig(**{**cfg.to_dict(), "overwrite_output_dir": overwrite}), progress=False)
        msg = str(e.value)
        assert "holds config.yaml, summary.json, which this run would write over" in msg, msg
        assert "another --output_dir" in msg, msg
        assert contents(out) == before


def test_the_config_file_in_the_output_dir_is_never_written_over(tmp_path, model_dirs, monkeypatch):
    """`fastdpo train --config config.yaml --output_dir .`: the run trains there and leaves the file as it was."""
    cfg = config(tmp_path, model_dirs("qwen3"), "run", max_steps=2, save_steps=2)
    out = Path(cfg.output_dir)
    out.mkdir()
    mine = out / "config.yaml"
    mine.write_text(f"# my settings\nmodel: {cfg.model}\nmax_steps: 2\n")
    monkeypatch.setattr(sys, "argv", ["fastdpo", "train", "--config", str(mine), "--output_dir", str(out)])
    assert train(cfg, progress=False)["final_dir"]
    assert mine.read_text().startswith("# my settings")
    # a resume of that run does not write over it either
    assert train(TrainConfig(**{**cfg.to_dict(), "resume_from_checkpoint": "latest"}), progress=False)["final_dir"]
    assert mine.read_text().startswith("# my settings")


def test_the_record_of_a_killed_run_names_what_it_created():
    """A run killed before it could update the record: the output names that appeared since it started are its."""
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        out = Path(d)
        (out / "notes.txt").write_text("mine")
        (out / "summary.json").write_text("mine")
        (out / outputs.RECORD).write_text(json.dumps({"created": ["gone.txt"], "started_with": ["notes.txt",
                                                                                                 "summary.json"]}))
        for name in ("metrics.jsonl", "config.yaml"):
            (out / name).write_text("{}")
        (out / "checkpoint-3").mkdir()
        assert outputs.run_outputs(out) == {"metrics.jsonl", "config.yaml", "checkpoint-3"}


# ---------------------------------------------------------------- a failed start


def test_a_failed_start_leaves_no_dir_it_created(tmp_path, model_dirs, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cfg = config(tmp_path, tmp_path / "modls" / "qwen3", "new/run", max_steps=2)
    with pytest.raises(FastDPOError, match="modls"):
        train(cfg, progress=False)
    assert not (tmp_path / "new").exists()


def test_a_failed_start_in_an_existing_dir_removes_only_what_it_created(tmp_path, model_dirs, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cfg = config(tmp_path, tmp_path / "modls" / "qwen3", "run", max_steps=2)
    out = Path(cfg.output_dir)
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(FastDPOError, match="modls"):
        train(cfg, progress=False)
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]


# ---------------------------------------------------------------- a lock whose pid now runs another program


def test_a_lock_whose_pid_now_runs_another_program_is_taken_over(tmp_path, model_dirs, caplog):
    """A record with no start time to compare (an older fastdpo's): the pid's command line is not a fastdpo run."""
    cfg = config(tmp_path, model_dirs("qwen3"), "run", max_steps=2)
    out = Path(cfg.output_dir)
    out.mkdir()
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (out / lock.LOCK).write_text(json.dumps({"pid": other.pid, "host": socket.gethostname(),
                                                      "started": "yesterday", "command": "fastdpo train x"}))
        with caplog.at_level("WARNING", logger="fastdpo"):
            assert train(cfg, progress=False)["final_dir"]
    finally:
        other.kill()
        other.wait()
    assert f"took over the lock of a run that is no longer running (pid {other.pid}" in caplog.text


def test_the_holder_is_told_apart_by_boot_and_command_line():
    me = lock.Holder.this_process()
    assert me.cmdline and me.boot_id
    # the same pid and start ticks in an earlier boot: the host restarted since, the holder is gone
    assert lock.Holder(me.pid, me.host, "", "", me.proc_start, "an-earlier-boot", me.cmdline).alive() is False
    # no start time recorded: the command line decides
    assert lock.Holder(me.pid, me.host, "", "", None, "", me.cmdline).alive() is True
    assert lock.Holder(me.pid, me.host, "", "", None, "", "python other.py").alive() is False


def test_a_failed_resume_keeps_the_checkpoint_it_put_back(finished, tmp_path):
    """A kill between the renames of a rewrite left checkpoint-4 as .checkpoint-4.new; the next start puts it back
    before it fails (here: another --beta), and that checkpoint is not a file the failed start may remove."""
    cfg = copy_run(finished, tmp_path, resume_from_checkpoint="latest", beta=0.5)
    out = Path(cfg.output_dir)
    os.replace(out / "checkpoint-4", out / ".checkpoint-4.new")
    with pytest.raises(FastDPOError, match="other settings"):
        train(cfg, progress=False)
    assert ckpt.checkpoint_problem(out / "checkpoint-4") is None
