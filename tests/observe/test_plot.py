"""`fastdpo plot`: the PNG dashboard from metrics.jsonl (and alerts.jsonl)."""

import importlib.util
import json
import math

import pytest

from fastdpo.cli import main
from fastdpo.errors import FastDPOError
from fastdpo.observe.plot import read_records, write_dashboard


@pytest.fixture(autouse=True)
def _logging(restore_logging):
    pass


def fake_run(out, steps=30, resumed_from=None):
    out.mkdir(parents=True, exist_ok=True)
    lines = []
    for s in range(1, steps + 1):
        acc = min(1.0, 0.5 + s / 40)
        rec = {"step": s, "loss": 0.69 * math.exp(-s / 20), "rewards/chosen": 0.01 * s, "rewards/rejected": -0.02 * s,
               "rewards/margins": 0.03 * s, "rewards/accuracies": acc, "kl/chosen": 0.002 * s,
               "kl/rejected": -0.003 * s, "kl": -0.0005 * s, "grad_norm": 1.0 / s, "learning_rate": 1e-6,
               "pairs_per_second": 40.0, "memory/peak_gib": 12.5, "skipped_steps": 1 if s >= 12 else 0}
        if s == 12:
            rec["loss"] = "nan"
        lines.append(rec)
    if resumed_from:  # a resumed run logs its steps again: the later lines win
        lines += [{**r, "loss": 0.1} for r in lines[resumed_from:]]
    (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    (out / "alerts.jsonl").write_text(json.dumps({"name": "nonfinite", "step": 12, "message": "m", "advice": "a",
                                                  "repeats": 0}) + "\n")
    return out


def test_read_records_keeps_the_last_line_of_each_step(tmp_path):
    run = fake_run(tmp_path / "run", steps=10, resumed_from=6)
    recs = read_records(run / "metrics.jsonl")
    assert [r["step"] for r in recs] == list(range(1, 11))
    assert [r["loss"] for r in recs[6:]] == [0.1] * 4
    with open(run / "metrics.jsonl", "a") as f:  # an evaluation logged at step 10 joins that step's record
        f.write(json.dumps({"step": 10, "eval_loss": 0.4}) + "\n")
    last = read_records(run / "metrics.jsonl")[-1]
    assert last["eval_loss"] == 0.4 and last["loss"] == 0.1


def test_plot_command_writes_a_png(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    run = fake_run(tmp_path / "run")
    assert main(["plot", str(run)]) == 0
    png = run / "metrics.png"
    assert str(png) in capsys.readouterr().out
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    assert (width, height) == (1500, 1100) and len(data) > 60_000
    other = tmp_path / "elsewhere.png"
    assert write_dashboard(run, other) == other and other.is_file()


def test_plot_errors_are_clear(tmp_path, monkeypatch, capsys):
    assert main(["plot", str(tmp_path / "nope")]) == 1
    assert "metrics.jsonl not found" in capsys.readouterr().out
    (tmp_path / "cut").mkdir()
    (tmp_path / "cut" / "metrics.jsonl").write_text('{"step": 1, "loss": 0.5}\n{"step": 2, "lo')
    with pytest.raises(FastDPOError, match=r"metrics.jsonl:2: not valid JSON"):
        write_dashboard(tmp_path / "cut")
    (tmp_path / "cut" / "metrics.jsonl").write_bytes(b'{"step": 1, "loss": 0.5}\n\xff\xfe\n')
    assert main(["plot", str(tmp_path / "cut")]) == 1
    out = capsys.readouterr().out
    assert "metrics.jsonl:2: not valid UTF-8" in out and "Remove that line" in out and "Traceback" not in out, out
    run = fake_run(tmp_path / "alerts", steps=3)
    with open(run / "alerts.jsonl", "ab") as f:
        f.write(b'{"name": "kl_ratio", \xff}\n')
    with pytest.raises(FastDPOError, match=r"alerts.jsonl:2: not valid UTF-8"):
        write_dashboard(run)

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FastDPOError, match="pip install matplotlib"):
        write_dashboard(fake_run(tmp_path / "ok", steps=3))


def full_disk(monkeypatch):
    """Every figure write fills the disk part-way through, as PIL meets ENOSPC."""
    import errno
    from pathlib import Path

    from matplotlib.figure import Figure

    def savefig(self, fname, **kw):
        if hasattr(fname, "write"):
            fname.write(b"\x89PNG\r\n\x1a\n cut")
        else:
            Path(fname).write_bytes(b"\x89PNG\r\n\x1a\n cut")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Figure, "savefig", savefig)


def test_a_full_disk_leaves_no_partial_png_and_says_so(tmp_path, monkeypatch, capsys):
    pytest.importorskip("matplotlib")
    run = fake_run(tmp_path / "run")
    assert main(["plot", str(run)]) == 0
    before = (run / "metrics.png").read_bytes()
    full_disk(monkeypatch)
    with pytest.raises(FastDPOError) as e:
        write_dashboard(run)
    msg = str(e.value)
    assert f"Writing the dashboard {run / 'metrics.png'} failed (No space left on device)" in msg, msg
    assert f"rerun `fastdpo plot {run}`" in msg, msg
    assert (run / "metrics.png").read_bytes() == before  # the earlier dashboard, whole
    with pytest.raises(FastDPOError):
        write_dashboard(run, tmp_path / "new.png")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]
    assert not list(run.glob(".metrics.png*"))
    capsys.readouterr()
    assert main(["plot", str(run)]) == 1
    out = capsys.readouterr().out
    assert "No space left on device" in out and "Traceback" not in out, out


def test_a_full_disk_while_plotting_ends_a_run_with_a_warning(tmp_path, monkeypatch, capsys, model_dirs):
    pytest.importorskip("matplotlib")
    from cli_helpers import run_cli
    from data_helpers import easy_rows, write_jsonl

    data = write_jsonl(tmp_path / "d.jsonl", easy_rows(8, seed=1))
    out = tmp_path / "run"
    full_disk(monkeypatch)
    rc, text = run_cli(capsys, "train", "--model", str(model_dirs("qwen3")), "--dataset", str(data), "--output_dir",
                       str(out), "--max_steps", "2", "--per_device_train_batch_size", "2", "--device", "cpu",
                       "--plot", "true", "--disable_progress", "true")
    flat = " ".join(text.split())
    assert rc == 0 and "Traceback" not in text, text
    assert f"--plot: Writing the dashboard {out / 'metrics.png'} failed (No space left on device)" in flat, flat
    assert (out / "final" / "model.safetensors").is_file()
    assert not (out / "metrics.png").exists() and not list(out.glob(".metrics.png*"))
