"""Ctrl-C and SIGTERM when the reader of stdout or stderr is gone (`fastdpo train ... 2>&1 | tee train.log`: the
same Ctrl-C ends `tee`): the run still saves its checkpoint, exits with the signal's code and says so in
`output_dir/train.log` and on any standard stream still open."""

import logging
import os
import pty
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from train_helpers import RUN_SETTINGS, logged_steps, run_config

from fastdpo import checkpoint as ckpt
from fastdpo.cli import main
from fastdpo.errors import FastDPOError
from fastdpo.observe.streams import GuardedStream, run_log
from fastdpo.training.signals import GracefulStop

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: identical float summation order across runs

STEPS = 40
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(sys.path)}


def reader() -> subprocess.Popen:
    """A process reading a pipe, like `tee`; killing it leaves the pipe without a reader."""
    return subprocess.Popen(["cat"], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL)


def train_argv(tmp_path: Path, model: Path) -> list[str]:
    cfg = run_config(tmp_path, model, "run", max_steps=STEPS)
    return ["train", "--model", str(model), "--dataset", cfg.dataset[0], "--output_dir", cfg.output_dir,
            "--max_steps", str(STEPS), "--logging_steps", "1", "--disable_progress", "true",
            *(x for k, v in RUN_SETTINGS.items() for x in (f"--{k}", str(v)))]


def start_training(tmp_path: Path, model: Path, stdout, stderr) -> tuple[subprocess.Popen, Path]:
    argv = [sys.executable, "-m", "fastdpo", *train_argv(tmp_path, model)]
    return subprocess.Popen(argv, stdout=stdout, stderr=stderr, env=ENV), tmp_path / "run"


def stop_after_readers_die(proc: subprocess.Popen, out: Path, readers: list, sig: int) -> int:
    """Wait for two logged steps, kill the readers, then send `sig`; the trainer's exit code."""
    for r in readers:
        r.stdin.close()  # the trainer holds the only write end
    try:
        end = time.monotonic() + 300
        while not ((out / "metrics.jsonl").exists() and (out / "metrics.jsonl").read_text().count("\n") >= 2):
            assert proc.poll() is None and time.monotonic() < end, _story(out)
            time.sleep(0.01)
        for r in readers:
            r.kill()
            r.wait()
        proc.send_signal(sig)
        return proc.wait(timeout=300)
    finally:
        proc.kill()
        for r in readers:
            r.kill()


def _story(out: Path) -> str:
    log = out / "train.log"
    return log.read_text() if log.exists() else f"no {log}"


def assert_stopped_and_saved(out: Path, name: str) -> int:
    story = _story(out)
    assert f"{name} received: finishing this step" in story, story
    assert f"Stopped by {name} after step" in story and "--resume_from_checkpoint latest" in story, story
    assert "run summary:" in story, story
    found = ckpt.complete_checkpoints(out)
    assert len(found) == 1 and not (out / "final").exists(), story
    step = ckpt.load_progress(found[0])["step"]
    assert 2 <= step < STEPS and [r[0] for r in logged_steps(out)] == list(range(1, step + 1))
    return step


def test_sigint_under_a_pipe_whose_reader_died_saves_and_resumes(tmp_path, model_dirs, restore_logging):
    tee = reader()
    proc, out = start_training(tmp_path, model_dirs("qwen3"), tee.stdin, subprocess.STDOUT)  # 2>&1 | tee
    assert stop_after_readers_die(proc, out, [tee], signal.SIGINT) == 130, _story(out)
    step = assert_stopped_and_saved(out, "SIGINT")

    assert main([*train_argv(tmp_path, model_dirs("qwen3")), "--resume_from_checkpoint", "latest"]) == 0
    assert (out / "final" / "model.safetensors").is_file()
    assert [r[0] for r in logged_steps(out)] == list(range(1, STEPS + 1))
    story = _story(out)
    assert story.index(f"Stopped by SIGINT after step {step}") < story.index("Resumed from") < story.rindex("run summary")


def test_sigterm_with_stdout_and_stderr_both_closed(tmp_path, model_dirs):
    readers = [reader(), reader()]
    proc, out = start_training(tmp_path, model_dirs("qwen3"), readers[0].stdin, readers[1].stdin)
    assert stop_after_readers_die(proc, out, readers, signal.SIGTERM) == 128 + signal.SIGTERM, _story(out)
    assert_stopped_and_saved(out, "SIGTERM")


@pytest.mark.parametrize("closed", ["stdout", "stderr"])
def test_the_stop_message_reaches_the_stream_still_open(tmp_path, model_dirs, closed):
    gone = reader()
    open_file = tmp_path / "open.txt"
    with open(open_file, "w") as f:
        streams = {"stdout": gone.stdin, "stderr": f} if closed == "stdout" else {"stdout": f, "stderr": gone.stdin}
        proc, out = start_training(tmp_path, model_dirs("qwen3"), **streams)
        assert stop_after_readers_die(proc, out, [gone], signal.SIGINT) == 130, _story(out)
    assert_stopped_and_saved(out, "SIGINT")
    shown = open_file.read_text()
    assert "SIGINT received: finishing this step" in shown, shown
    assert "stopped by SIGINT: checkpoint in" in shown and "Stopped by SIGINT after step" in shown, shown
    assert "Traceback" not in shown and "Exception ignored" not in shown, shown


# ---------------------------------------------------------------- the pieces, in process


@pytest.mark.parametrize("kind", ["pipe", "terminal"])
def test_a_broken_stream_is_dropped_once_and_its_text_goes_to_the_other(tmp_path, kind):
    r, w = os.pipe() if kind == "pipe" else pty.openpty()
    os.close(r)  # no reader (EPIPE), or the terminal closed (EIO)
    other = GuardedStream(open(tmp_path / "other.txt", "w", buffering=1))
    stream = GuardedStream(os.fdopen(w, "w", buffering=1), other)
    stream.write("first\n")
    assert stream.broken and not other.broken
    assert os.fstat(w).st_rdev == os.stat(os.devnull).st_rdev  # later writes, and the flush at exit, go nowhere
    stream.write("second\n")
    stream.writelines(["third\n"])
    stream.flush()
    other.flush()
    assert (tmp_path / "other.txt").read_text() == "first\nsecond\nthird\n"


def test_the_flush_at_exit_into_a_closed_pipe_is_not_an_error(tmp_path):
    script = textwrap.dedent("""
        import sys
        from fastdpo.observe.streams import guard_std_streams
        guard_std_streams()
        sys.stdin.read()  # until the reader of stdout is gone
        print("held in the buffer until exit")
    """)
    with open(tmp_path / "err.txt", "w") as err:
        proc = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=err, env=ENV)
        proc.stdout.close()
        proc.stdin.close()
        rc = proc.wait(timeout=60)
    text = (tmp_path / "err.txt").read_text()
    assert rc == 0 and "Exception ignored" not in text, text  # unguarded: 120 and a BrokenPipeError message
    assert "held in the buffer until exit" in text  # stdout's text went to stderr


def test_sigpipe_is_ignored_while_a_stop_is_armed():
    before = signal.getsignal(signal.SIGPIPE)
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # as a library or an embedding program may leave it
    try:
        with GracefulStop():
            assert signal.getsignal(signal.SIGPIPE) == signal.SIG_IGN
        assert signal.getsignal(signal.SIGPIPE) == signal.SIG_DFL
    finally:
        signal.signal(signal.SIGPIPE, before)


def test_the_run_log_keeps_the_records_and_the_error_that_ended_the_run(tmp_path):
    log = logging.getLogger("fastdpo")
    level = log.level
    log.setLevel(logging.INFO)
    try:
        with pytest.raises(FastDPOError), run_log(tmp_path, append=False):
            log.info("step one")
            raise FastDPOError("the disk is full")
        with run_log(tmp_path, append=True):
            log.info("resumed")
        with run_log(tmp_path, append=True, write=False):
            log.info("another rank")
    finally:
        log.setLevel(level)
    text = (tmp_path / "train.log").read_text()
    assert "INFO     step one" in text and "run ended: FastDPOError: the disk is full" in text
    assert text.count("run started") == 2 and "resumed" in text and "another rank" not in text
    assert not [h for h in log.handlers if h.__class__.__name__ == "RunLog"]
