"""The Python API (`from fastdpo import ...`) and the one training step that train, bench, tune and auto share."""

import json

import pytest
import torch
from data_helpers import easy_rows, write_jsonl
from safetensors.torch import load_file
from train_helpers import two_step_config


def test_the_python_api_trains_step_by_step_and_whole(tmp_path, model_dirs):
    from fastdpo import LOSSES, Trainer, train

    assert "sigmoid" in LOSSES and "simpo" in LOSSES
    cfg = two_step_config(tmp_path, model_dirs("qwen3"), "steps")
    trainer = Trainer(cfg)
    before = {k: v.clone() for k, v in trainer.s.model.state_dict().items()}
    first = trainer.step()
    second = trainer.step()
    assert trainer.global_step == 2 and first.finite and second.stepped
    assert [p.index for p in first.pairs] == [0, 1, 2, 3]  # shuffle off: the data's own order
    loss = first.metrics.finish()["loss"]
    assert 0 < loss < 10
    assert any(not torch.equal(before[k], v) for k, v in trainer.s.model.state_dict().items())
    summary = train(two_step_config(tmp_path, model_dirs("qwen3"), "whole"), progress=False)
    assert summary["last"]["step"] == 2
    assert (tmp_path / "whole" / "final" / "model.safetensors").is_file()


def test_a_bench_step_and_a_train_step_give_the_same_weights(tmp_path, model_dirs):
    """The measuring path (a Trainer around an assembled setup, fed explicit pairs, as bench/tune/auto do) and the
    training loop reach bit-identical weights from the same state: there is one step, not two."""
    from fastdpo import Trainer, train
    from fastdpo.model.load import load_model, load_tokenizer, resolve_device, resolve_dtype
    from fastdpo.training.setup import assemble, load_data, seed_all

    m = model_dirs("qwen3")
    # max_grad_norm 0 means no clipping in training; a copy of the step once zeroed every gradient there instead
    kw = dict(max_grad_norm=0.0, output_dir=str(tmp_path / "unused"))
    trained = load_file(train(two_step_config(tmp_path, m, "loop", max_grad_norm=0.0), progress=False)["final_dir"]
                        + "/model.safetensors")
    cfg = two_step_config(tmp_path, m, "bench", **{k: v for k, v in kw.items() if k != "output_dir"})
    device = resolve_device(cfg.device)
    seed_all(cfg.seed)
    tokenizer = load_tokenizer(cfg.model)
    _, pairs = load_data(cfg, tokenizer)
    model = load_model(cfg.model, resolve_dtype(cfg.torch_dtype, device), device)
    trainer = Trainer(cfg, assemble(cfg, device, model, tokenizer, pairs))
    trainer.step(pairs[0:4])
    trainer.step(pairs[4:8])
    benched = trainer.s.model.state_dict()
    assert trained.keys() <= benched.keys()
    moved = 0
    for k, v in trained.items():
        assert torch.equal(v, benched[k]), k
        moved += not torch.equal(v, load_file(f"{m}/model.safetensors").get(k, v))
    assert moved  # the steps changed the weights: the comparison is not between two untouched models


def test_bench_and_tune_time_trainer_step(monkeypatch):
    """`run_fastdpo` (bench, tune, auto) drives Trainer.step for every warm-up and timed step."""
    from fastdpo.config import TrainConfig
    from fastdpo.data.anchor import anchor_pairs
    from fastdpo.training import measure
    from fastdpo.training.trainer import Trainer

    calls = []
    real = Trainer.step

    def counted(self, pairs=None, then=None):
        calls.append((len(pairs), len(then) if then else 0))
        return real(self, pairs, then)

    monkeypatch.setattr(Trainer, "step", counted)
    cfg = TrainConfig(model="shape", dataset=["anchor"], per_device_train_batch_size=2, max_length=2048,
                      device="cpu", torch_dtype="float32")
    rows = anchor_pairs(10, vocab=1000, prompt_mean=8, resp_mean=6)
    r = measure.run_fastdpo(cfg, "tiny", rows, steps=2, warmup=1, verbose=False)
    assert calls == [(2, 2), (2, 2), (2, 0)] and r["pairs_per_s"] > 0  # each step names the next (packed ahead)


def test_the_next_step_is_packed_ahead_and_trains_exactly_as_packed_in_turn(tmp_path, model_dirs, monkeypatch):
    """Each step packs the next one's first micro-batch before waiting for its own update; a step then uses that
    batch instead of packing it again, and the weights equal those of steps that pack in turn. Pairs other than
    the ones packed ahead (a caller's own) are packed afresh."""
    from fastdpo import Trainer
    from fastdpo.training import trainer as trainer_mod

    packed = []
    real_pack = trainer_mod.pack_micro_batch
    monkeypatch.setattr(trainer_mod, "pack_micro_batch",
                        lambda s, group, step_pairs: packed.append([p.index for p in group]) or real_pack(s, group,
                                                                                                       step_pairs))
    kw = dict(max_steps=3, per_device_train_batch_size=2, gradient_accumulation_steps=2)
    ahead = Trainer(two_step_config(tmp_path, model_dirs("qwen3"), "ahead", **kw))
    for _ in range(3):
        ahead.step()
        packed.append("end")
    # 3 steps x 2 micro-batches, each packed once: steps 2 and 3's first during the step before
    assert packed == [[0, 1], [2, 3], [4, 5], "end", [6, 7], [8, 9], "end", [10, 11], "end"]
    packed.clear()
    in_turn = Trainer(two_step_config(tmp_path, model_dirs("qwen3"), "in_turn", **kw))
    in_turn.pack_ahead = False
    for _ in range(3):
        in_turn.step()
        packed.append("end")
    assert packed == [[0, 1], [2, 3], "end", [4, 5], [6, 7], "end", [8, 9], [10, 11], "end"]
    for k, v in ahead.s.model.state_dict().items():
        assert torch.equal(v, in_turn.s.model.state_dict()[k]), k
    packed.clear()
    other = Trainer(two_step_config(tmp_path, model_dirs("qwen3"), "other", **kw))
    other.step(then=other.s.pairs[8:12])
    other.step(other.s.pairs[4:8])  # not what was packed ahead: packed again
    assert packed == [[0, 1], [2, 3], [8, 9], [4, 5], [6, 7]]


# ---------------------------------------------------------------- data in memory, the result, callbacks


def in_memory_config(tmp_path, model_dir, name, dataset, **kw):
    from fastdpo import TrainConfig

    base = dict(learning_rate=1e-3, max_steps=2, logging_steps=1, seed=5, per_device_train_batch_size=4,
                gradient_accumulation_steps=1, dataset_cache_dir=str(tmp_path / "cache"))
    return TrainConfig(model=str(model_dir), dataset=dataset, output_dir=str(tmp_path / name), **{**base, **kw})


def dataset_kinds(tmp_path, rows):
    """The same rows as each kind `TrainConfig(dataset=...)` takes."""
    import datasets

    half = len(rows) // 2
    first, second = write_jsonl(tmp_path / "a.jsonl", rows[:half]), write_jsonl(tmp_path / "b.jsonl", rows[half:])
    whole = write_jsonl(tmp_path / "all.jsonl", rows)
    ds = datasets.Dataset.from_list(rows)
    return {"list of dicts": rows, "Dataset": ds, "DatasetDict": datasets.DatasetDict(train=ds, test=ds.select([0])),
            "IterableDataset": ds.to_iterable_dataset(), "list of paths": [str(first), str(second)],
            "path string": str(whole)}


def test_every_kind_of_dataset_trains_the_same(tmp_path, model_dirs):
    """A list of dicts, a Dataset, a DatasetDict (its train split), an IterableDataset, a list of paths and a single
    path string train alike: the same pairs, the same first losses and the same weights."""
    from fastdpo import train

    rows = easy_rows(16, seed=2)
    results = {}
    for kind, data in dataset_kinds(tmp_path, rows).items():
        name = kind.replace(" ", "_")
        result = train(in_memory_config(tmp_path, model_dirs("qwen3"), name, data), progress=False)
        results[kind] = ([json.loads(line)["loss"] for line in (tmp_path / name / "metrics.jsonl").open()],
                         result.model.state_dict())
    losses, weights = results.pop("path string")
    assert len(losses) == 2
    for kind, (other_losses, other_weights) in results.items():
        assert other_losses == losses, kind
        assert all(torch.equal(weights[k], v) for k, v in other_weights.items()), kind


def test_in_memory_rows_are_checked_like_files_and_named_by_index(tmp_path, model_dirs):
    from fastdpo import TrainConfig, train
    from fastdpo.errors import FastDPOError

    rows = easy_rows(8)
    rows[3] = {"prompt": "w1", "chosen": "w2"}  # no rejected
    with pytest.raises(FastDPOError, match="row 3"):
        train(in_memory_config(tmp_path, model_dirs("qwen3"), "bad", rows), progress=False)
    with pytest.raises(FastDPOError, match=r"dataset\[1\] is a dict among other entries"):
        TrainConfig(dataset=["a.jsonl", {"prompt": "p"}])
    assert TrainConfig(dataset="rows.jsonl").dataset == ["rows.jsonl"]  # one path, not one per character


def test_the_tokenisation_cache_keys_rows_in_memory_by_content(tmp_path, model_dirs):
    import datasets

    from fastdpo.data.load import load_rows
    from fastdpo.data.prepare import DataOptions, tokenize_pairs
    from fastdpo.model.load import load_tokenizer

    tok = load_tokenizer(str(model_dirs("qwen3")))

    def tokenise(rows) -> bool:
        cfg = in_memory_config(tmp_path, model_dirs("qwen3"), "unused", datasets.Dataset.from_list(rows))
        opts = DataOptions.from_config(cfg)
        return tokenize_pairs(load_rows(cfg.dataset, read=opts.read), tok, opts)[1].cached

    rows = easy_rows(8, seed=1)
    assert not tokenise(rows)
    assert tokenise([dict(r) for r in rows])  # another object, the same content: a hit
    rows[5]["chosen"] = " w6 w5"
    assert not tokenise(rows)  # one text changed: a miss


def test_train_returns_the_trained_model_equal_to_the_saved_one(tmp_path, model_dirs):
    from fastdpo import TrainResult, train

    result = train(in_memory_config(tmp_path, model_dirs("qwen3"), "run", easy_rows(16, seed=2)), progress=False)
    assert isinstance(result, TrainResult) and not result.stopped and result.exit_code == 0
    assert result.final_dir == str(tmp_path / "run" / "final") and result["final_dir"] == result.final_dir
    assert result.metrics["step"] == 2 and result.summary is result.info["run_summary"]
    assert not result.model.training and result.tokenizer is not None
    saved = load_file(f"{result.final_dir}/model.safetensors")
    weights = result.model.state_dict()
    assert saved.keys() <= weights.keys()
    assert all(torch.equal(v, weights[k]) for k, v in saved.items())
    moved = load_file(f"{model_dirs('qwen3')}/model.safetensors")
    assert any(not torch.equal(v, moved[k]) for k, v in saved.items() if k in moved)
    text = (tmp_path / "run" / "config.yaml").read_text()
    assert "dataset:\n- '<in-memory: 16 rows, fingerprint " in text  # the label, not the rows


def test_a_saved_in_memory_label_is_refused_with_what_to_do(tmp_path):
    from fastdpo.data.load import load_rows
    from fastdpo.errors import FastDPOError

    with pytest.raises(FastDPOError, match="given in memory"):
        load_rows(["<in-memory: 16 rows, fingerprint 0123456789abcdef>"])


def test_callbacks_fire_at_their_steps(tmp_path, model_dirs):
    from fastdpo import train

    calls = []

    class Recorder:
        def on_train_begin(self, trainer):
            calls.append(("begin", trainer.global_step))

        def on_evaluate(self, step, metrics):
            calls.append(("evaluate", step, "eval_loss" in metrics))

        def on_save(self, step, path):
            calls.append(("save", step, path.name))

        def on_train_end(self, result):
            calls.append(("end", result.final_dir is not None))

    steps = []
    rows = easy_rows(16, seed=2)
    cfg = in_memory_config(tmp_path, model_dirs("qwen3"), "hooks", rows, max_steps=4, logging_steps=2, save_steps=2,
                           eval_steps=2, val_dataset=rows[:4])
    train(cfg, progress=False, callbacks=[Recorder(), lambda step, metrics: steps.append((step, metrics["step"]))])
    assert steps == [(2, 2), (4, 4)]
    saves = [c[1:] for c in calls if c[0] == "save"]
    assert saves[0] == (2, "checkpoint-2") and saves[-1] == (4, "final")  # each checkpoint, then the final model
    assert all(name == f"checkpoint-{step}" for step, name in saves[:-1])
    assert [c for c in calls if c[0] != "save"] == [("begin", 0), ("evaluate", 2, True), ("evaluate", 4, True),
                                                    ("end", True)]
    assert calls.index(("evaluate", 2, True)) < calls.index(("save", 2, "checkpoint-2"))


def test_a_callback_stops_the_run_with_a_checkpoint_that_resumes_exactly(tmp_path, model_dirs):
    """on_step returning "stop" saves a checkpoint and stops; resumed with the same rows (a new object), the run ends
    with the weights of a run never stopped."""
    import datasets

    from fastdpo import train

    rows, m = easy_rows(16, seed=2), model_dirs("qwen3")
    whole = train(in_memory_config(tmp_path, m, "whole", rows, max_steps=4), progress=False)
    stopped = train(in_memory_config(tmp_path, m, "cut", rows, max_steps=4), progress=False,
                    callbacks=[lambda step, metrics: "stop" if step == 2 else None])
    assert stopped.stopped == "callback" and stopped.exit_code == 0 and stopped.final_dir is None
    assert stopped.checkpoint == str(tmp_path / "cut" / "checkpoint-2")
    resumed = train(in_memory_config(tmp_path, m, "cut", datasets.Dataset.from_list(rows), max_steps=4,
                                     resume_from_checkpoint="latest"), progress=False)
    assert resumed.metrics["step"] == 4
    weights = resumed.model.state_dict()
    assert all(torch.equal(v, weights[k]) for k, v in whole.model.state_dict().items())
