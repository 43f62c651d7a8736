"""Checkpoints prove their content and a resume refuses what it cannot honour: the content manifest (a flipped bit
in any file), step counters, NaN/Inf weights, `latest` naming what it skipped, another model / data / objective,
the publish of a rewritten checkpoint under a kill at every point, and clear messages for failed writes and loads."""

import errno
import json
import shutil
from pathlib import Path

import pytest
import torch
from checkpoint_helpers import reseal
from cli_helpers import run_cli
from data_helpers import easy_rows, write_jsonl
from safetensors.torch import load_file, save_file

from fastdpo import checkpoint as ckpt
from fastdpo.checkpoint import outputs, publish
from fastdpo.config import TrainConfig
from fastdpo.errors import FastDPOError
from fastdpo.observe import sinks
from fastdpo.training.loop import train

BASE = dict(learning_rate=1e-3, per_device_train_batch_size=2, gradient_accumulation_steps=2, seed=3, device="cpu")

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def trained(tmp_path_factory, model_dirs):
    """A finished 3-step run that kept checkpoint-1 and checkpoint-2; copy it before changing it."""
    root = tmp_path_factory.mktemp("trained")
    data = write_jsonl(root / "data.jsonl", easy_rows(48, seed=1))
    cfg = TrainConfig(model=str(model_dirs("qwen3")), dataset=[str(data)], output_dir=str(root / "run"), max_steps=3,
                      save_steps=1, **BASE)
    train(cfg, progress=False)
    return cfg


def resume_copy(trained: TrainConfig, tmp_path: Path, **changes) -> TrainConfig:
    out = tmp_path / "run"
    shutil.copytree(trained.output_dir, out)
    shutil.rmtree(out / "checkpoint-3", ignore_errors=True)  # the finished run's last step: resume mid-run instead
    return TrainConfig(**{**trained.to_dict(), "output_dir": str(out), "resume_from_checkpoint": "latest", **changes})


def flip_bit(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def perturbed_copy(src: Path, dst: Path, scale: float = 1.01) -> Path:
    shutil.copytree(src, dst)
    state = load_file(str(dst / "model.safetensors"))
    save_file({k: v * scale for k, v in state.items()}, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


# ---------------------------------------------------------------- content


def test_a_same_size_bit_flip_in_any_checkpoint_file_is_detected(trained, tmp_path):
    pristine = Path(trained.output_dir) / "checkpoint-2"
    files = [p.relative_to(pristine) for p in sorted(pristine.rglob("*")) if p.is_file()]
    assert {"model.safetensors", "state/optimizer.pt", "state/rng.pt", "state/trainer_state.json",
            ckpt.MANIFEST} <= {str(f) for f in files}
    assert ckpt.checkpoint_problem(pristine) is None
    for rel in files:
        out = tmp_path / rel.as_posix().replace("/", "_")
        out.mkdir()
        shutil.copytree(pristine, out / "checkpoint-2")
        shutil.copytree(pristine.with_name("checkpoint-1"), out / "checkpoint-1")
        size = (out / "checkpoint-2" / rel).stat().st_size
        flip_bit(out / "checkpoint-2" / rel)
        assert (out / "checkpoint-2" / rel).stat().st_size == size
        problem = ckpt.checkpoint_problem(out / "checkpoint-2")
        assert problem, rel
        if rel.as_posix() != ckpt.MANIFEST:  # a flipped manifest may name the file whose digest it garbled
            assert rel.as_posix() in problem or "unreadable" in problem, (rel, problem)
        assert ckpt.resolve_resume("latest", out) == out / "checkpoint-1", rel
        with pytest.raises(FastDPOError, match="not a complete fastdpo checkpoint"):
            ckpt.resolve_resume(str(out / "checkpoint-2"), out)


def test_a_flipped_weight_bit_is_caught_before_training_continues(trained, tmp_path, caplog):
    cfg = resume_copy(trained, tmp_path)
    out = Path(cfg.output_dir)
    flip_bit(out / "checkpoint-2" / "model.safetensors")
    with caplog.at_level("INFO", logger="fastdpo"):
        train(cfg, progress=False)
    assert ("skipped checkpoint-2 (model.safetensors differs from what was written (same size, other content)); "
            f"resuming from {out / 'checkpoint-1'}") in caplog.text
    assert f"Resumed from {out / 'checkpoint-1'} at step 1" in caplog.text


def test_a_swapped_optimizer_state_of_the_same_size_is_detected(trained, tmp_path):
    cfg = resume_copy(trained, tmp_path)
    out = Path(cfg.output_dir)
    one, two = (out / f"checkpoint-{n}" / "state" / "optimizer.pt" for n in (1, 2))
    assert one.stat().st_size == two.stat().st_size
    shutil.copy(one, two)
    assert ckpt.checkpoint_problem(out / "checkpoint-2") == "state/optimizer.pt differs from what was written (same " \
                                                            "size, other content)"
    assert ckpt.is_complete(out / "checkpoint-2")  # sizes alone cannot tell


def test_every_checkpoint_unusable_stops_unless_asked_to_start_over(trained, tmp_path, capsys, restore_logging):
    cfg = resume_copy(trained, tmp_path)
    out = Path(cfg.output_dir)
    for n in (1, 2):
        flip_bit(out / f"checkpoint-{n}" / "state" / "optimizer.pt")
    args = ["train", "--model", cfg.model, "--dataset", cfg.dataset[0], "--output_dir", str(out), "--max_steps", "3",
            "--resume_from_checkpoint", "latest", "--disable_progress", "true",
            *[x for k, v in BASE.items() for x in (f"--{k}", str(v))]]
    rc, text = run_cli(capsys, *args)
    assert rc == 1 and "Traceback" not in text, text
    flat = " ".join(text.split())
    assert "none of the 2 checkpoints" in flat and "checkpoint-2 (state/optimizer.pt differs" in flat, flat
    assert "checkpoint-1 (state/optimizer.pt differs" in flat and "--start_over_if_unusable true" in flat, flat
    rc, text = run_cli(capsys, *args, "--start_over_if_unusable", "true")
    assert rc == 0 and "--start_over_if_unusable: training from step 0" in " ".join(text.split()), text
    assert [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3]


def test_no_checkpoint_at_all_still_starts_from_step_zero(trained, tmp_path, model_dirs):
    """`latest` on the first attempt of a job that may be restarted: nothing to resume is not an error."""
    cfg = TrainConfig(**{**trained.to_dict(), "output_dir": str(tmp_path / "new"), "resume_from_checkpoint": "latest"})
    assert train(cfg, progress=False)["final_dir"]


@pytest.mark.parametrize("step", [100, -3, 0, "2"])
def test_edited_step_counters_are_refused(trained, tmp_path, step):
    cfg = resume_copy(trained, tmp_path)
    out = Path(cfg.output_dir)
    done = out / "checkpoint-2" / ckpt.STATE / ckpt.DONE
    done.write_text(json.dumps({**json.loads(done.read_text()), "step": step}))
    reseal(out / "checkpoint-2")
    assert "step counter" in ckpt.checkpoint_problem(out / "checkpoint-2")
    assert ckpt.resolve_resume("latest", out) == out / "checkpoint-1"
    with pytest.raises(FastDPOError, match="step counter"):
        ckpt.resolve_resume(str(out / "checkpoint-2"), out)


def test_a_checkpoint_past_the_end_of_the_run_is_refused(trained, tmp_path):
    cfg = resume_copy(trained, tmp_path, max_steps=1)
    with pytest.raises(FastDPOError, match="written at step 2, past the 1 steps this run trains"):
        train(cfg, progress=False)


def as_before_manifests(c: Path) -> None:
    """Make `c` look like a checkpoint of an earlier version: sizes only, no manifest, no run record."""
    (c / ckpt.MANIFEST).unlink()
    done = c / ckpt.STATE / ckpt.DONE
    state = json.loads(done.read_text())
    del state["manifest"], state["run"]
    done.write_text(json.dumps(state))


@pytest.mark.parametrize("how", ["removed", "before manifests"])
def test_a_checkpoint_without_manifest_is_refused_unless_trusted(trained, tmp_path, caplog, how):
    cfg = resume_copy(trained, tmp_path)
    c = Path(cfg.output_dir) / "checkpoint-2"
    cfg.resume_from_checkpoint = str(c)
    if how == "removed":
        (c / ckpt.MANIFEST).unlink()
    else:
        as_before_manifests(c)
    with pytest.raises(FastDPOError) as e:
        train(cfg, progress=False)
    msg = str(e.value)
    assert f"{ckpt.MANIFEST} is missing, so its content cannot be verified" in msg, msg
    assert "--trust_unverified_checkpoint true" in msg, msg
    assert ckpt.resolve_resume("latest", Path(cfg.output_dir)) == c.with_name("checkpoint-1")  # the verified one
    cfg.trust_unverified_checkpoint = True
    with caplog.at_level("INFO", logger="fastdpo"):
        train(cfg, progress=False)
    assert f"{c} has no content manifest ({ckpt.MANIFEST}): resuming it unverified" in caplog.text
    assert f"Resumed from {c} at step 2" in caplog.text
    assert ("compared by path only" in caplog.text) == (how == "before manifests")


def stray_weights(c: Path) -> tuple[Path, str]:
    """A zeroed copy of the embeddings dropped into `c` as another .safetensors file."""
    state = load_file(str(c / "model.safetensors"))
    key = next(k for k in state if "embed_tokens" in k)
    stray = c / "zz-extra.safetensors"
    save_file({key: torch.zeros_like(state[key])}, str(stray), metadata={"format": "pt"})
    return stray, key


@pytest.mark.parametrize("where", ["zz-extra.safetensors", "state/zz-extra.safetensors"])
def test_a_file_the_manifest_does_not_list_is_refused_by_name(trained, tmp_path, where):
    cfg = resume_copy(trained, tmp_path)
    out = Path(cfg.output_dir)
    c = out / "checkpoint-2"
    stray, _ = stray_weights(c)
    stray.rename(c / where)
    problem = ckpt.checkpoint_problem(c)
    assert problem == f"{where} is not listed in {ckpt.MANIFEST}: it was not written with this directory and " \
                      "would be loaded unverified; remove it", problem
    with pytest.raises(FastDPOError, match=f"not a complete fastdpo checkpoint \\({where} is not listed"):
        ckpt.resolve_resume(str(c), out)
    assert ckpt.resolve_resume("latest", out) == out / "checkpoint-1"
    (c / where).unlink()
    assert ckpt.checkpoint_problem(c) is None


def test_only_the_model_files_are_loaded_from_an_unverified_checkpoint(trained, tmp_path):
    """Without a manifest (trusted), a stray .safetensors file is still not read as weights."""
    from fastdpo.checkpoint import restore
    from fastdpo.model.load import load_model

    c = tmp_path / "checkpoint-2"
    shutil.copytree(Path(trained.output_dir) / "checkpoint-2", c)
    _, key = stray_weights(c)
    model = load_model(trained.model, torch.float32, torch.device("cpu"))
    restore.load_weights(model, c)
    saved = load_file(str(c / "model.safetensors"))
    assert torch.equal(model.state_dict()[key], saved[key]) and saved[key].abs().sum() > 0


# ---------------------------------------------------------------- what loads


def test_nan_weights_in_a_checkpoint_are_refused_on_load(trained, tmp_path):
    cfg = resume_copy(trained, tmp_path)
    c = Path(cfg.output_dir) / "checkpoint-2"
    state = load_file(str(c / "model.safetensors"))
    key = next(k for k in state if "layers.1.mlp.down_proj" in k)
    state[key][0, 0] = float("nan")
    save_file(state, str(c / "model.safetensors"), metadata={"format": "pt"})
    reseal(c)  # consistent: NaN written with the checkpoint, or a checkpoint from before manifests
    with pytest.raises(FastDPOError) as e:
        train(cfg, progress=False)
    msg = str(e.value)
    assert str(c) in msg and f"NaN/Inf values in {key}" in msg and "Resume from an earlier checkpoint" in msg, msg
    assert "learning_rate" not in msg


def test_inf_weights_in_the_model_are_refused_before_training(tmp_path, model_dirs):
    m = tmp_path / "m"
    shutil.copytree(model_dirs("qwen3"), m)
    state = load_file(str(m / "model.safetensors"))
    key = next(k for k in state if k.endswith("norm.weight"))
    state[key][0] = float("inf")
    save_file(state, str(m / "model.safetensors"), metadata={"format": "pt"})
    data = write_jsonl(tmp_path / "d.jsonl", easy_rows(16, seed=1))
    cfg = TrainConfig(model=str(m), dataset=[str(data)], output_dir=str(tmp_path / "run"), max_steps=2, **BASE)
    with pytest.raises(FastDPOError) as e:
        train(cfg, progress=False)
    msg = str(e.value)
    assert f"--model {m}: NaN/Inf values in {key}" in msg and "before any training step" in msg, msg
    assert "not a learning-rate problem" in msg and "Lower --learning_rate" not in msg
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


@pytest.mark.parametrize("content,expected", [
    ("numpy", "holds objects other than tensors and plain containers"),
    ("layout", "not the random-number state fastdpo writes"),
])
def test_an_unloadable_rng_state_is_a_clear_error(trained, tmp_path, content, expected):
    import numpy as np

    cfg = resume_copy(trained, tmp_path)
    c = Path(cfg.output_dir) / "checkpoint-2"
    torch.save({"python": np.zeros(3)} if content == "numpy" else {"python": 1, "torch": "x"}, c / "state" / "rng.pt")
    reseal(c)
    with pytest.raises(FastDPOError) as e:
        train(cfg, progress=False)
    msg = str(e.value)
    assert "rng.pt" in msg and expected in msg and "weights_only" not in msg, msg


# ---------------------------------------------------------------- what the run was


def test_resume_with_another_model_of_the_same_architecture_is_refused(trained, tmp_path, model_dirs):
    other = perturbed_copy(model_dirs("qwen3"), tmp_path / "other")
    with pytest.raises(FastDPOError) as e:
        train(resume_copy(trained, tmp_path, model=str(other)), progress=False)
    msg = str(e.value)
    assert f"--model {trained.model} → {other} (other weights)" in msg and "--resume_ignore_changes true" in msg, msg


def test_a_model_changed_in_place_is_refused(trained, tmp_path, model_dirs):
    m = tmp_path / "m"
    shutil.copytree(model_dirs("qwen3"), m)
    cfg = TrainConfig(**{**trained.to_dict(), "model": str(m), "output_dir": str(tmp_path / "run"), "max_steps": 2})
    train(cfg, progress=False)
    (m / "model.safetensors").unlink()
    perturbed_copy(model_dirs("qwen3"), tmp_path / "p")
    shutil.copy(tmp_path / "p" / "model.safetensors", m / "model.safetensors")
    cfg.resume_from_checkpoint = "latest"
    with pytest.raises(FastDPOError, match=rf"--model {m} → {m} \(same path, its files changed since\)"):
        train(cfg, progress=False)


def test_another_architecture_is_refused_clearly_even_when_changes_are_allowed(trained, tmp_path, model_dirs):
    other = model_dirs("qwen3", hidden_size=32, head_dim=8)
    with pytest.raises(FastDPOError) as e:
        train(resume_copy(trained, tmp_path, model=str(other)), progress=False)
    assert "hidden_size 64" in str(e.value) and "hidden_size 32" in str(e.value), str(e.value)
    shutil.rmtree(tmp_path / "run")
    with pytest.raises(FastDPOError) as e:
        train(resume_copy(trained, tmp_path, model=str(other), resume_ignore_changes=True), progress=False)
    msg = str(e.value)
    assert "its weights do not fit this model" in msg and "in this model" in msg and "size mismatch" not in msg, msg


def test_resume_with_another_dataset_is_refused_but_a_moved_copy_is_not(trained, tmp_path):
    other = write_jsonl(tmp_path / "other.jsonl", easy_rows(48, seed=7))
    with pytest.raises(FastDPOError) as e:
        train(resume_copy(trained, tmp_path, dataset=[str(other)]), progress=False)
    msg = str(e.value)
    assert f"the training data: --dataset {trained.dataset[0]} → {other} (other pairs" in msg, msg
    shutil.rmtree(tmp_path / "run")
    moved = shutil.copy(trained.dataset[0], tmp_path / "moved.jsonl")
    assert train(resume_copy(trained, tmp_path, dataset=[str(moved)]), progress=False)["final_dir"]


def test_changed_objective_settings_are_each_named_and_can_be_allowed(trained, tmp_path, caplog):
    changes = dict(loss_type="ipo", beta=0.3, seed=4, max_length=9, shuffle=False)
    with pytest.raises(FastDPOError) as e:
        train(resume_copy(trained, tmp_path, **changes), progress=False)
    msg = str(e.value)
    for named in ("--loss_type sigmoid (weights default) → ipo (weights default)", "--beta 0.1 → 0.3",
                  "--seed 3 → 4", "--max_length 2048 → 9", "--shuffle True → False", "the training data"):
        assert named in msg, (named, msg)
    assert "state/config.yaml, usable as --config" in msg
    shutil.rmtree(tmp_path / "run")
    with caplog.at_level("WARNING", logger="fastdpo"):
        assert train(resume_copy(trained, tmp_path, resume_ignore_changes=True, **changes), progress=False)["final_dir"]
    assert "--resume_ignore_changes true" in caplog.text and "--beta 0.1 → 0.3" in caplog.text


def test_learning_rate_and_unrelated_flags_may_change(trained, tmp_path, caplog):
    cfg = resume_copy(trained, tmp_path, learning_rate=1e-4, simpo_gamma=0.9, logging_steps=2)
    with caplog.at_level("WARNING", logger="fastdpo"):
        assert train(cfg, progress=False)["final_dir"]
    assert "changed learning-rate schedule" in caplog.text and "other settings" not in caplog.text


# ---------------------------------------------------------------- publishing under a kill


class Killed(BaseException):
    """Stands for SIGKILL: nothing in the code under test catches it."""


def test_rewriting_a_checkpoint_keeps_the_old_or_the_new_copy_at_every_kill_point(trained, tmp_path, monkeypatch):
    import os

    from fastdpo.model.load import load_model, load_tokenizer
    from fastdpo.optim.optimizer import build_optimizer, build_scheduler

    src = Path(trained.output_dir)
    old = load_file(str(src / "checkpoint-2" / "model.safetensors"))
    model = load_model(str(src / "final"), torch.float32, torch.device("cpu"))
    new = {k: v.clone() for k, v in model.state_dict().items()}
    assert any(not torch.equal(old[k], new[k]) for k in old)
    opt = build_optimizer(model, trained, torch.device("cpu"))
    sched, tok = build_scheduler(opt, trained, 3), load_tokenizer(str(src / "final"))
    real = {"replace": os.replace, "fsync": os.fsync, "rmtree": shutil.rmtree}
    outcomes, window = [], 0
    for n in range(1, 200):
        out = tmp_path / f"kill{n}"
        shutil.copytree(src, out)
        calls = [0]

        def counted(name, calls=calls, n=n):
            def call(*a, **kw):
                calls[0] += 1
                if calls[0] == n:
                    raise Killed
                return real[name](*a, **kw)
            return call

        monkeypatch.setattr(os, "replace", counted("replace"))
        monkeypatch.setattr(os, "fsync", counted("fsync"))
        monkeypatch.setattr(shutil, "rmtree", counted("rmtree"))
        try:
            ckpt.save_checkpoint(out, 2, model, tok, opt, sched, {"epoch": 0}, trained)
            killed = False
        except Killed:
            killed = True
        finally:
            monkeypatch.undo()
        window += killed and not (out / "checkpoint-2").exists()  # killed while no copy had the public name
        ckpt.clean_partial(out)  # what the next start does
        c = out / "checkpoint-2"
        assert ckpt.checkpoint_problem(c) is None, (n, sorted(p.name for p in out.iterdir()))
        got = load_file(str(c / "model.safetensors"))
        outcomes.append("new" if all(torch.equal(got[k], new[k]) for k in got) else
                        "old" if all(torch.equal(got[k], old[k]) for k in got) else "mixed")
        assert outcomes[-1] != "mixed", n
        assert not [p.name for p in out.iterdir() if p.name.startswith(".") and p.name != outputs.RECORD], n
        if not killed:
            break
    assert not killed and outcomes[-1] == "new" and "old" in outcomes
    assert window >= 1  # the kills covered the instant between the renames


# ---------------------------------------------------------------- failed writes


def test_disk_full_while_appending_metrics_is_one_clear_error(trained, tmp_path, monkeypatch, capsys, restore_logging):
    def full(self, record):
        if record["step"] >= 3:
            raise OSError(errno.ENOSPC, "No space left on device")
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()

    def close(self):  # flushing what was buffered fails on the full disk too
        self.file.close()
        self.alerts.close()
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(sinks.JsonlSink, "log", full)
    monkeypatch.setattr(sinks.JsonlSink, "close", close)
    out = tmp_path / "run"
    args = ["train", "--model", trained.model, "--dataset", trained.dataset[0], "--output_dir", str(out), "--max_steps",
            "4", "--save_steps", "2", "--disable_progress", "true", *[x for k, v in BASE.items() for x in (f"--{k}", str(v))]]
    rc, text = run_cli(capsys, *args)
    flat = " ".join(text.split())
    assert rc == 1 and "Traceback" not in text, text
    assert f"Writing metrics.jsonl in {out} failed (No space left on device)" in flat, flat
    assert f"the last good checkpoint is {out / 'checkpoint-2'}" in flat and "--resume_from_checkpoint latest" in flat


def test_a_torch_writer_failure_reads_as_the_disk_being_full(tmp_path, monkeypatch):
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage._replace(free=1024))
    err = ckpt.write_failed("checkpoint-3", tmp_path, RuntimeError(" . unexpected pos 6419008 vs 6418896"))
    assert "(no space left on device)" in str(err) and "unexpected pos" not in str(err)
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage._replace(free=1 << 40))
    err = ckpt.write_failed("checkpoint-3", tmp_path, RuntimeError(" . unexpected pos 6419008 vs 6418896"))
    assert "(the file was cut short: unexpected pos 6419008 vs 6418896)" in str(err)


def test_files_are_synced_while_they_are_written_and_the_flusher_stops_on_errors(tmp_path, monkeypatch):
    """The flusher syncs the files of the directory being written while the writer still writes (so the disk works
    beside it), leaves the bytes as written, and stops with the block that raised."""
    import time

    synced = []
    monkeypatch.setattr(publish, "_datasync", lambda fd: synced.append(time.perf_counter()))
    root = tmp_path / ".final.tmp"
    root.mkdir()
    blocks = [bytes([i]) * 4096 for i in range(20)]
    with publish.Flusher(root, interval=0.005) as flusher:
        with open(root / "model.safetensors", "wb") as f:
            for block in blocks:
                f.write(block)
                f.flush()
                time.sleep(0.01)
        written = time.perf_counter()
    assert flusher.synced >= 3 and sum(t < written for t in synced) >= 3
    assert (root / "model.safetensors").read_bytes() == b"".join(blocks)
    assert not flusher._thread.is_alive()
    with pytest.raises(OSError):
        with publish.Flusher(root, interval=0.005) as flusher:
            raise OSError(errno.ENOSPC, "No space left on device")
    assert not flusher._thread.is_alive()


# ---------------------------------------------------------------- several ranks


def test_two_ranks_share_rank_0s_decisions_and_verify_sharded_checkpoints(tmp_path, model_dirs):
    from dist_helpers import BASE as RANKS_BASE
    from dist_helpers import dataset, join_ranks, run_ranks, start_ranks

    out = tmp_path / "ws2"
    kw = dict(model=str(model_dirs("qwen3")), dataset=[str(dataset(tmp_path))], output_dir=str(out),
              per_device_train_batch_size=2, gradient_accumulation_steps=2, save_steps=3, **RANKS_BASE)
    run_ranks(2, **kw)
    c = out / "checkpoint-3"
    assert ckpt.checkpoint_problem(c) is None
    listed = json.loads((c / ckpt.MANIFEST).read_text())["files"]
    assert "state/rng-1.pt" in listed and any(k.startswith("sharded/__1_") for k in listed), sorted(listed)
    stray = c / "sharded" / "__2_0.distcp"  # a shard of no rank that wrote this checkpoint
    stray.write_bytes(b"\0" * 64)
    assert ckpt.checkpoint_problem(c).startswith(f"sharded/__2_0.distcp is not listed in {ckpt.MANIFEST}")
    stray.unlink()
    # rank 0 refuses a fresh run into the finished dir; rank 1 stops with it instead of waiting in a collective
    assert join_ranks(start_ranks(2, **kw), timeout=120) == [1, 1]
    # a resume: rank 0 verifies and picks the checkpoint, both ranks load it (the last step's checkpoint-6 removed,
    # so that steps 4-6 are trained again)
    ckpt.remove_published(out / "checkpoint-6")
    run_ranks(2, **{**kw, "resume_from_checkpoint": "latest"})
    assert [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()] == list(range(1, 7))
    # a flipped bit in rank 1's shard of each checkpoint: nothing left to resume, both ranks stop
    for c in ckpt.numbered_checkpoints(out):
        flip_bit(next((c / "sharded").glob("__1_*.distcp")))
    assert join_ranks(start_ranks(2, **{**kw, "resume_from_checkpoint": "latest"}), timeout=120) == [1, 1]
