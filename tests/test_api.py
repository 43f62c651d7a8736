"""The Python API (`from fastdpo import ...`) and the one training step that train, bench, tune and auto share."""

import torch
from conftest import easy_rows, write_jsonl
from safetensors.torch import load_file


def config(tmp_path, model_dir, name, **kw):
    from fastdpo import TrainConfig

    data = write_jsonl(tmp_path / "data.jsonl", easy_rows(16, seed=2))
    base = dict(learning_rate=1e-3, max_steps=2, logging_steps=1, seed=5, per_device_train_batch_size=4,
                gradient_accumulation_steps=1, shuffle=False)
    return TrainConfig(model=str(model_dir), dataset=[str(data)], output_dir=str(tmp_path / name), **{**base, **kw})


def test_the_python_api_trains_step_by_step_and_whole(tmp_path, model_dirs):
    from fastdpo import LOSSES, Trainer, train

    assert "sigmoid" in LOSSES and "simpo" in LOSSES
    cfg = config(tmp_path, model_dirs("qwen3"), "steps")
    trainer = Trainer(cfg)
    before = {k: v.clone() for k, v in trainer.s.model.state_dict().items()}
    first = trainer.step()
    second = trainer.step()
    assert trainer.global_step == 2 and first.finite and second.stepped
    assert [p.index for p in first.pairs] == [0, 1, 2, 3]  # shuffle off: the data's own order
    loss = first.metrics.finish()["loss"]
    assert 0 < loss < 10
    assert any(not torch.equal(before[k], v) for k, v in trainer.s.model.state_dict().items())
    summary = train(config(tmp_path, model_dirs("qwen3"), "whole"), progress=False)
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
    trained = load_file(train(config(tmp_path, m, "loop", max_grad_norm=0.0), progress=False)["final_dir"]
                        + "/model.safetensors")
    cfg = config(tmp_path, m, "bench", **{k: v for k, v in kw.items() if k != "output_dir"})
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
    ahead = Trainer(config(tmp_path, model_dirs("qwen3"), "ahead", **kw))
    for _ in range(3):
        ahead.step()
        packed.append("end")
    # 3 steps x 2 micro-batches, each packed once: steps 2 and 3's first during the step before
    assert packed == [[0, 1], [2, 3], [4, 5], "end", [6, 7], [8, 9], "end", [10, 11], "end"]
    packed.clear()
    in_turn = Trainer(config(tmp_path, model_dirs("qwen3"), "in_turn", **kw))
    in_turn.pack_ahead = False
    for _ in range(3):
        in_turn.step()
        packed.append("end")
    assert packed == [[0, 1], [2, 3], "end", [4, 5], [6, 7], "end", [8, 9], [10, 11], "end"]
    for k, v in ahead.s.model.state_dict().items():
        assert torch.equal(v, in_turn.s.model.state_dict()[k]), k
    packed.clear()
    other = Trainer(config(tmp_path, model_dirs("qwen3"), "other", **kw))
    other.step(then=other.s.pairs[8:12])
    other.step(other.s.pairs[4:8])  # not what was packed ahead: packed again
    assert packed == [[0, 1], [2, 3], [8, 9], [4, 5], [6, 7]]
