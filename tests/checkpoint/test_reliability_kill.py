"""SIGKILL at random moments (and, if none of them falls inside a checkpoint's write, at the start of writes), resume
with `latest`, repeat: the final weights equal an uninterrupted run's.

The killed processes are forked from one warmed-up parent (imports done, one-thread torch), so a restart costs
milliseconds instead of the seconds an import of torch + transformers takes; each child is still a separate
process running the real CLI (`fastdpo train ... --resume_from_checkpoint latest`) and is ended by SIGKILL, with no
chance to clean up. The parent runs in a subprocess of its own so the test process never forks itself.
"""

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

from data_helpers import easy_rows, write_jsonl

from fastdpo.checkpoint.outputs import RECORD

MIN_KILLS = 20
STEPS = 36


def train_argv(model: str, data: str, out: str) -> list[str]:
    return ["train", "--model", model, "--dataset", data, "--output_dir", out, "--device", "cpu",
            "--max_steps", str(STEPS), "--save_steps", "1", "--save_total_limit", "2",
            "--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "2", "--learning_rate", "1e-3",
            "--lr_scheduler_type", "cosine", "--warmup_steps", "3", "--weight_decay", "0.01", "--seed", "3",
            "--disable_progress", "true"]


def test_sigkill_at_random_moments_then_resume_is_exact(tmp_path, model_dirs):
    data = write_jsonl(tmp_path / "data.jsonl", easy_rows(48, seed=1))
    spec = {"model": str(model_dirs("qwen3")), "data": str(data), "root": str(tmp_path), "seed": 1234}
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1]), *sys.path])}
    res = subprocess.run([sys.executable, __file__, json.dumps(spec)], env=env, capture_output=True, text=True,
                         timeout=600)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
    report = json.loads((tmp_path / "report.json").read_text())
    print(report)
    assert report["kills"] >= MIN_KILLS, report
    assert report["kills_mid_write"] >= 1, report  # some kills landed while a checkpoint was being written
    assert report["newest_went_back"] == [], report  # a kill never cost the newest complete checkpoint

    from safetensors.torch import load_file

    ref = load_file(str(tmp_path / "reference" / "final" / "model.safetensors"))
    got = load_file(str(tmp_path / "killed" / "final" / "model.safetensors"))
    assert ref.keys() == got.keys()
    for k in ref:
        assert ref[k].dtype == got[k].dtype and ref[k].dtype.is_floating_point
        assert ref[k].equal(got[k]), k

    def logged(name):  # the metrics log reads as if the run had never been interrupted
        rows = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        return [(r["step"], r["loss"], r["grad_norm"], r["learning_rate"]) for r in rows]

    assert logged("killed") == logged("reference")
    # no temporary file or dir is left behind; the record of the names runs created stays, as in any run dir
    hidden = {p.name for p in (tmp_path / "killed").iterdir() if p.name.startswith(".")}
    assert hidden == {p.name for p in (tmp_path / "reference").iterdir() if p.name.startswith(".")} == {RECORD}


# ---------------------------------------------------------------- the forking parent (runs in a subprocess)


def _child(argv: list[str], log_path: Path) -> int:
    pid = os.fork()
    if pid:
        return pid
    rc = 99
    try:
        fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        from fastdpo.cli import main

        rc = main(argv)
    except BaseException:  # noqa: B036 - report anything, then leave without running the parent's cleanup
        import traceback

        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(rc)


def _wait(pid: int, timeout: float) -> int | None:
    """Exit status of `pid` if it ends within `timeout` seconds, else None."""
    end = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        if time.monotonic() >= end:
            return None
        time.sleep(0.005)


def _writing(out: Path) -> bool:
    """A checkpoint is being written in `out` (its temporary dir exists)."""
    entries = list(out.iterdir()) if out.is_dir() else []  # a kill can land before the run has created its output dir
    return any(p.name.startswith(".checkpoint-") and p.name.endswith(".tmp") for p in entries)


def _wait_for_write(pid: int, out: Path, timeout: float) -> int | None:
    """Exit status of `pid` if it ends before a checkpoint write is seen in `out` within `timeout` seconds, else
    None (then it is killed while writing, or at the timeout)."""
    end = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        if _writing(out) or time.monotonic() >= end:
            return None
        time.sleep(0.0005)


def _newest(out: Path) -> int:
    from fastdpo.checkpoint.layout import complete_checkpoints

    found = complete_checkpoints(out)
    return int(found[-1].name.split("-")[1]) if found else 0


def _check_loadable(out: Path) -> None:
    """The newest complete checkpoint really loads (not only has the right file sizes)."""
    import torch
    from safetensors.torch import load_file

    from fastdpo.checkpoint.layout import complete_checkpoints

    found = complete_checkpoints(out)
    if found:
        load_file(str(found[-1] / "model.safetensors"))
        torch.load(found[-1] / "state" / "optimizer.pt", weights_only=True)


def _parent(spec: dict) -> None:
    import torch

    torch.set_num_threads(1)
    from fastdpo.cli import main

    root = Path(spec["root"])
    rng = random.Random(spec["seed"])
    logs = root / "logs.txt"
    # warm up the imports and lazy initialisations once, so that forked children start fast
    assert main([*train_argv(spec["model"], spec["data"], str(root / "warmup")), "--max_steps", "2"]) == 0
    t0 = time.monotonic()
    pid = _child(train_argv(spec["model"], spec["data"], str(root / "reference")), logs)
    assert _wait(pid, 300) == 0, logs.read_text()[-3000:]
    step_time = (time.monotonic() - t0) / STEPS  # setup included: a generous per-step estimate

    out = root / "killed"
    argv = [*train_argv(spec["model"], spec["data"], str(out)), "--resume_from_checkpoint", "latest"]
    kills = mid_write = 0
    went_back, delays = [], []
    window = 2.0 * step_time
    for _ in range(20 * STEPS):
        before = _newest(out)
        left = STEPS - before
        # until enough kills have happened, aim at about one step of progress per kill
        delay = rng.uniform(0, window if left > 2 * (MIN_KILLS - kills) else window / 3)
        # random moments rarely fall inside a checkpoint's write: once half the kills are done without one, each
        # next kill waits for a write to start (the resume after it must be as exact as after any other)
        aimed = mid_write == 0 and kills >= MIN_KILLS // 2
        started = time.monotonic()
        pid = _child(argv, logs)
        rc = _wait_for_write(pid, out, 4 * window) if aimed else _wait(pid, delay)
        if rc is None:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            kills += 1
            delays.append(round(time.monotonic() - started if aimed else delay, 3))
            mid_write += _writing(out)
            after = _newest(out)
            if after < before:
                went_back.append((before, after))
            _check_loadable(out)
            window *= 1.15 if after == before else (0.85 if after - before > 1 else 1.0)
            continue
        assert rc == 0, logs.read_text()[-3000:]
        break
    report = {"kills": kills, "kills_mid_write": mid_write, "newest_went_back": went_back,
              "step_time": step_time, "delays": delays, "seconds": time.monotonic() - t0}
    (root / "report.json").write_text(json.dumps(report))


if __name__ == "__main__":
    _parent(json.loads(sys.argv[1]))
