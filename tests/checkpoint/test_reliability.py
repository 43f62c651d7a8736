"""Graceful SIGTERM/SIGINT stops, write failures, the disk pre-flight, crash-safe checkpoint files, safe loading."""

import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from checkpoint_helpers import reseal
from safetensors.torch import load_file
from train_helpers import RUN_SETTINGS, logged_steps, run_config

from fastdpo import checkpoint as ckpt
from fastdpo.checkpoint.outputs import RECORD
from fastdpo.config import TrainConfig
from fastdpo.errors import FastDPOError
from fastdpo.training.loop import train
from fastdpo.training.signals import GracefulStop


def assert_same_weights(a: Path, b: Path) -> None:
    x, y = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    assert x.keys() == y.keys()
    for k in x:
        assert torch.equal(x[k], y[k]), k


def wait_for_steps(out: Path, n: int, proc=None, timeout: float = 300) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        path = out / "metrics.jsonl"
        if path.exists() and path.read_text().count("\n") >= n:
            return
        assert proc is None or proc.poll() is None, proc.communicate()[0][-3000:]
        time.sleep(0.005)
    raise AssertionError(f"no step {n} in {out} after {timeout} s")


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: identical float summation order across runs


@pytest.fixture(scope="module")
def trained(tmp_path_factory, model_dirs):
    """A finished 3-step run that kept checkpoint-1 and checkpoint-2 (its last step's checkpoint-3 removed); copy it
    before changing it."""
    root = tmp_path_factory.mktemp("trained")
    cfg = run_config(root, model_dirs("qwen3"), "run", max_steps=3, save_steps=1)
    train(cfg, progress=False)
    ckpt.remove_published(Path(cfg.output_dir) / "checkpoint-3")
    return cfg


def copy_run(trained: TrainConfig, tmp_path: Path) -> TrainConfig:
    out = tmp_path / "run"
    shutil.copytree(trained.output_dir, out)
    return TrainConfig(**{**trained.to_dict(), "output_dir": str(out)})


# ---------------------------------------------------------------- signals


def test_sigterm_checkpoints_exits_cleanly_and_resume_is_exact(tmp_path, model_dirs):
    m = model_dirs("qwen3")
    cfg = run_config(tmp_path, m, "stopped", max_steps=30)
    argv = [sys.executable, "-m", "fastdpo", "train", "--model", str(m), "--dataset", cfg.dataset[0],
            "--output_dir", cfg.output_dir, "--max_steps", "30", "--disable_progress", "true"]
    for k, v in RUN_SETTINGS.items():
        argv += [f"--{k}", str(v)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        wait_for_steps(Path(cfg.output_dir), 2, proc)
        proc.send_signal(signal.SIGTERM)
        output = proc.communicate(timeout=300)[0]
    finally:
        proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, output
    assert "Traceback" not in output, output
    assert "stopped by SIGTERM" in output and "--resume_from_checkpoint latest" in output, output
    out = Path(cfg.output_dir)
    found = ckpt.complete_checkpoints(out)
    assert len(found) == 1 and not (out / "final").exists()
    stopped_at = ckpt.load_progress(found[0])["step"]
    assert 2 <= stopped_at < 30
    assert [r[0] for r in logged_steps(out)] == list(range(1, stopped_at + 1))

    cfg.resume_from_checkpoint = "latest"
    resumed = train(cfg, progress=False)
    full = train(run_config(tmp_path, m, "full", max_steps=30), progress=False)
    assert_same_weights(Path(full["final_dir"]), Path(resumed["final_dir"]))
    assert logged_steps(out) == logged_steps(tmp_path / "full")


def test_sigint_in_process_returns_stopped_summary(tmp_path, model_dirs):
    cfg = run_config(tmp_path, model_dirs("qwen3"), "run", max_steps=40)
    out = Path(cfg.output_dir)

    def interrupt():
        wait_for_steps(out, 2)
        os.kill(os.getpid(), signal.SIGINT)

    handler = signal.getsignal(signal.SIGINT)  # the default, or SIG_IGN in a shell's background job
    sender = threading.Thread(target=interrupt, daemon=True)
    sender.start()
    result = train(cfg, progress=False)
    sender.join()
    assert result["stopped"] == "SIGINT" and result["exit_code"] == 130 and result["final_dir"] is None
    step = ckpt.load_progress(Path(result["checkpoint"]))["step"]
    assert 2 <= step < 40 and ckpt.complete_checkpoints(out) == [Path(result["checkpoint"])]
    assert signal.getsignal(signal.SIGINT) is handler  # handlers restored


def _deliver(sig: int) -> None:
    os.kill(os.getpid(), sig)
    for _ in range(100):  # the Python-level handler runs at the next bytecode boundary
        time.sleep(0.001)


def test_second_sigint_aborts_but_a_repeated_sigterm_does_not():
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    with GracefulStop() as stop:
        _deliver(signal.SIGTERM)
        assert stop.requested and stop.name == "SIGTERM"
        _deliver(signal.SIGTERM)  # e.g. a launcher forwarding the scheduler's signal again
        assert stop.name == "SIGTERM"
        with pytest.raises(KeyboardInterrupt):
            _deliver(signal.SIGINT)
    assert {s: signal.getsignal(s) for s in before} == before
    with GracefulStop() as stop:
        _deliver(signal.SIGINT)
        assert stop.name == "SIGINT" and stop.exit_code() == 130
        with pytest.raises(KeyboardInterrupt):
            _deliver(signal.SIGINT)


# ---------------------------------------------------------------- disk: pre-flight and write failures


@pytest.mark.parametrize("what", ["checkpoint", "final"])
def test_write_failure_stops_and_names_last_good_checkpoint(tmp_path, model_dirs, monkeypatch, what):
    resource = pytest.importorskip("resource")
    cfg = run_config(tmp_path, model_dirs("qwen3"), "run", max_steps=4, save_steps=1)
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # writes past the limit then fail with EFBIG
    calls = []

    def fill_disk(fn):
        def wrapped(*a, **kw):
            calls.append(1)
            if what == "final" or len(calls) == 3:  # a real OS-level write failure from here on
                resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, limit[1]))
            return fn(*a, **kw)

        return wrapped

    monkeypatch.setattr(ckpt, "save_final" if what == "final" else "save_checkpoint",
                        fill_disk(getattr(ckpt, "save_final" if what == "final" else "save_checkpoint")))
    try:
        with pytest.raises(FastDPOError) as e:
            train(cfg, progress=False)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limit)
        signal.signal(signal.SIGXFSZ, old_handler)
    out = Path(cfg.output_dir)
    good = out / ("checkpoint-4" if what == "final" else "checkpoint-2")
    msg = str(e.value)
    assert "failed" in msg and str(good) in msg and "--resume_from_checkpoint latest" in msg, msg
    assert ("the final model" if what == "final" else "checkpoint-3") in msg, msg
    assert ckpt.complete_checkpoints(out)[-1] == good and ckpt.is_complete(good)
    assert not [p.name for p in out.iterdir() if p.name.startswith(".") and p.name != RECORD]  # no half-written leftovers
    assert not (out / "final").exists()


def test_preflight_refuses_a_too_full_disk(tmp_path, model_dirs, monkeypatch):
    cfg = run_config(tmp_path, model_dirs("qwen3"), "run", max_steps=2)
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage._replace(free=200 * 1024))
    with pytest.raises(FastDPOError, match=r"only 0\.2 MiB free, but one checkpoint needs about .* MiB"):
        train(cfg, progress=False)
    assert not (Path(cfg.output_dir) / "metrics.jsonl").exists()  # refused before training


def test_unwritable_output_dir_is_refused(tmp_path, model_dirs):
    (tmp_path / "file").write_text("x")
    cfg = run_config(tmp_path, model_dirs("qwen3"), "file/run", max_steps=2)
    with pytest.raises(FastDPOError, match="is not writable"):
        train(cfg, progress=False)


@pytest.mark.parametrize("train_type", ["full", "lora"])
def test_checkpoint_size_estimate_is_close(tmp_path, model_dirs, train_type):
    from fastdpo.model.load import add_lora, load_model

    m = model_dirs("llama")
    cfg = run_config(tmp_path, m, "run", max_steps=2, save_steps=1, train_type=train_type, lora_rank=4)
    train(cfg, progress=False)
    model = load_model(str(m), torch.float32, torch.device("cpu"))
    if train_type == "lora":
        model = add_lora(model, cfg.lora_rank, cfg.lora_alpha, cfg.lora_dropout, cfg.target_modules)
    weights, optim = ckpt.estimate_checkpoint_bytes(model, str(m))
    actual = sum(p.stat().st_size for p in (Path(cfg.output_dir) / "checkpoint-1").rglob("*") if p.is_file())
    assert 0.95 < (weights + optim) / actual < 1.25, (weights, optim, actual)


# ---------------------------------------------------------------- checkpoint files


def _fake_checkpoint(out: Path, step: int) -> Path:
    p = out / f"checkpoint-{step}"
    (p / ckpt.STATE).mkdir(parents=True)
    (p / "model.safetensors").write_bytes(b"x" * step)
    (p / ckpt.STATE / ckpt.DONE).write_text(json.dumps({"step": step, "files": {"model.safetensors": step}}))
    return p


def test_rotation_never_deletes_the_newest_or_the_one_just_written(tmp_path):
    for n in (2, 4, 6, 10):
        _fake_checkpoint(tmp_path, n)
    ckpt.rotate(tmp_path, 2)
    assert [p.name for p in ckpt.complete_checkpoints(tmp_path)] == ["checkpoint-6", "checkpoint-10"]
    # resumed from an older checkpoint: checkpoint-7 is the one just written, checkpoint-10 the highest
    ckpt.rotate(tmp_path, 1, keep=_fake_checkpoint(tmp_path, 7))
    assert [p.name for p in ckpt.complete_checkpoints(tmp_path)] == ["checkpoint-7", "checkpoint-10"]
    ckpt.rotate(tmp_path, 0)  # 0 keeps all
    assert len(ckpt.complete_checkpoints(tmp_path)) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-10", "checkpoint-7"]  # no trash left


def test_latest_skips_a_checkpoint_whose_files_do_not_match(trained, tmp_path):
    cfg = copy_run(trained, tmp_path)
    out = Path(cfg.output_dir)
    weights = out / "checkpoint-2" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])  # torn write, e.g. a filesystem that lost the tail
    assert ckpt.resolve_resume("latest", out) == out / "checkpoint-1"
    with pytest.raises(FastDPOError, match="not a complete fastdpo checkpoint"):
        ckpt.resolve_resume(str(out / "checkpoint-2"), out)


def test_leftovers_of_interrupted_writes_are_cleaned_and_never_resumed(trained, tmp_path):
    cfg = copy_run(trained, tmp_path)
    out = Path(cfg.output_dir)
    shutil.copytree(out / "checkpoint-2", out / ".checkpoint-3.tmp")  # killed before its rename
    (out / ".final.tmp").mkdir()
    (out / ".checkpoint-1.del").mkdir()
    assert ckpt.resolve_resume("latest", out) == out / "checkpoint-2"
    ckpt.clean_partial(out)
    assert sorted(p.name for p in out.iterdir() if p.is_dir()) == ["checkpoint-1", "checkpoint-2", "final"]


def test_rewriting_a_checkpoint_replaces_it_whole(trained, tmp_path):
    from fastdpo.model.load import load_model, load_tokenizer
    from fastdpo.optim.optimizer import build_optimizer, build_scheduler

    cfg = copy_run(trained, tmp_path)
    out = Path(cfg.output_dir)
    (out / "checkpoint-2" / "stale.txt").write_text("from an earlier run")
    model = load_model(str(out / "final"), torch.float32, torch.device("cpu"))
    opt = build_optimizer(model, cfg, torch.device("cpu"))
    path = ckpt.save_checkpoint(out, 2, model, load_tokenizer(str(out / "final")), opt, build_scheduler(opt, cfg, 3),
                                {"epoch": 0}, cfg)
    assert path == out / "checkpoint-2" and ckpt.is_complete(path) and not (path / "stale.txt").exists()
    assert_same_weights(out / "final", path)
    assert not [p.name for p in out.iterdir() if p.name.startswith(".") and p.name != RECORD]


def test_resume_trims_the_metrics_log(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 1.0}\n{"step": 2, "loss": 0.9}\n{"step": 3, "loss": 0.8}\n{"step": 4, "lo')
    ckpt.truncate_metrics(path, 2)
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2]


# ---------------------------------------------------------------- safe loading


class _RunsCode:
    """Unpickling this runs code: creates the file named by `marker`."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


def test_tampered_training_state_is_refused_without_running_code(trained, tmp_path):
    cfg = copy_run(trained, tmp_path)
    out = Path(cfg.output_dir)
    marker = tmp_path / "code-ran"
    state = out / "checkpoint-2" / "state"
    (state / "optimizer.pt").write_bytes(pickle.dumps({"state": _RunsCode(str(marker))}))
    reseal(out / "checkpoint-2")  # a consistent manifest, too: what loads must be safe by itself
    cfg.resume_from_checkpoint = "latest"
    with pytest.raises(FastDPOError, match="optimizer.pt: not a loadable training state"):
        train(cfg, progress=False)
    assert not marker.exists()


def test_corrupt_checkpoint_weights_are_a_clear_error(trained, tmp_path):
    cfg = copy_run(trained, tmp_path)
    weights = Path(cfg.output_dir) / "checkpoint-2" / "model.safetensors"
    weights.write_bytes(b"\0" * weights.stat().st_size)
    reseal(weights.parent)  # a consistent manifest (the content check is tested in test_checkpoint_verify.py)
    cfg.resume_from_checkpoint = "latest"
    with pytest.raises(FastDPOError, match="model.safetensors: unreadable weights"):
        train(cfg, progress=False)


def test_pickled_model_weights_are_refused_without_running_code(tmp_path, model_dirs):
    from fastdpo.model.load import load_model

    m = tmp_path / "m"
    shutil.copytree(model_dirs("qwen3"), m)
    (m / "model.safetensors").unlink()
    marker = tmp_path / "code-ran"
    (m / "pytorch_model.bin").write_bytes(pickle.dumps({"w": _RunsCode(str(marker))}))
    with pytest.raises(FastDPOError, match="holds objects other than tensors"):
        load_model(str(m), torch.float32, torch.device("cpu"))
    assert not marker.exists()


def test_custom_model_code_needs_trust_remote_code(tmp_path, model_dirs):
    from fastdpo.model.load import load_model

    m = tmp_path / "m"
    shutil.copytree(model_dirs("qwen3"), m)
    marker = tmp_path / "code-ran"
    cfg = json.loads((m / "config.json").read_text())
    cfg.update(model_type="custom_lm", auto_map={"AutoConfig": "custom.Config", "AutoModelForCausalLM": "custom.LM"})
    (m / "config.json").write_text(json.dumps(cfg))
    (m / "custom.py").write_text(f"import os\nos.mkdir({str(marker)!r})\n")
    assert TrainConfig().trust_remote_code is False
    with pytest.raises(FastDPOError, match="custom code.*--trust_remote_code true"):
        load_model(str(m), torch.float32, torch.device("cpu"))
    assert not marker.exists()


def test_a_write_probe_left_by_a_kill_is_removed_by_the_next_run(tmp_path, monkeypatch):
    from fastdpo.checkpoint.ownership import check_output_dir

    out = tmp_path / "out"
    out.mkdir()
    (out / ".fastdpo_write_test.rank0").write_text("ok")  # a kill landed between the probe's write and unlink
    check_output_dir(out)
    monkeypatch.setenv("RANK", "1")
    check_output_dir(out)
    assert [p.name for p in out.iterdir()] == []
