"""Reference strategies end to end on tiny CPU models: precompute (cache, invalidation, no reference in memory),
reference-free losses, TR-DPO sync, --ref_adapters, adaptive beta, and step-coupled losses under accumulation."""

import gc
import json
import shutil

import pytest
import torch
from data_helpers import easy_rows, write_jsonl
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, PreTrainedModel

import fastdpo.dpo.refcache
import fastdpo.training.loop
import fastdpo.training.trainer
from fastdpo.commands.precompute import precompute_ref
from fastdpo.config import TrainConfig
from fastdpo.data.pack import pack_pairs
from fastdpo.dpo.reference import Reference
from fastdpo.model.backend import Backend, prepare_packed
from fastdpo.model.seqlogps import completion_logps
from fastdpo.training.loop import train
from fastdpo.training.setup import build_setup


def long_chosen_rows(n: int, seed: int = 0) -> list[dict]:
    """The easy task with the longer answer preferred, so summed log-probs start out preferring rejected."""
    return [{**r, "chosen": r["rejected"], "rejected": r["chosen"]} for r in easy_rows(n, seed)]


def config(tmp_path, model_dir, name, rows=None, **kw):
    data = write_jsonl(tmp_path / f"data-{name}.jsonl", rows if rows is not None else easy_rows(48, seed=1))
    base = dict(learning_rate=1e-3, max_steps=6, logging_steps=1, seed=3, per_device_train_batch_size=8,
                ref_cache_dir=str(tmp_path / "cache"))
    return TrainConfig(model=str(model_dir), dataset=[str(data)], output_dir=str(tmp_path / name), **{**base, **kw})


def run(tmp_path, model_dir, name, rows=None, **kw):
    return train(config(tmp_path, model_dir, name, rows, **kw), progress=False)


def metrics(tmp_path, name):
    return [json.loads(line) for line in open(tmp_path / name / "metrics.jsonl")]


def weights(result):
    return load_file(f"{result['final_dir']}/model.safetensors")


def live_models():
    """Causal LMs alive in this process (their inner decoder models are PreTrainedModels too, and not counted).
    Training freezes what exists when it starts, out of the collector's sight, so the census lifts the freeze and
    sets it again."""
    frozen = gc.get_freeze_count() > 0
    gc.unfreeze()
    try:
        gc.collect()
        return [o for o in gc.get_objects() if isinstance(o, PreTrainedModel) and o.get_output_embeddings() is not None]
    finally:
        if frozen:
            gc.freeze()


def count_models_during_training(monkeypatch, tmp_path, model_dir, name, max_steps=2, **kw):
    """Run a short training and return the transformers models created by it that are alive during step 1."""
    before = {id(m) for m in live_models()}
    seen = []
    real = fastdpo.training.trainer.run_step

    def spy(s, step_pairs, m, ahead=None):
        if not seen:
            seen.append([m for m in live_models() if id(m) not in before])
        return real(s, step_pairs, m, ahead)

    monkeypatch.setattr(fastdpo.training.trainer, "run_step", spy)
    result = run(tmp_path, model_dir, name, max_steps=max_steps, **kw)
    return seen[0], result


# ---------------------------------------------------------------- precompute


def test_precompute_gives_the_online_loss_curve(tmp_path, model_dirs):
    m = model_dirs("qwen3")
    kw = dict(per_device_train_batch_size=4, gradient_accumulation_steps=2, adam_epsilon=1e-6)
    online = run(tmp_path, m, "online", **kw)
    pre = run(tmp_path, m, "pre", precompute_ref_log_probs=True, **kw)
    assert (online["reference"], pre["reference"]) == ("copy", "precompute")
    for a, b in zip(metrics(tmp_path, "online"), metrics(tmp_path, "pre"), strict=True):
        for key in ("loss", "rewards/chosen", "rewards/margins", "rewards/accuracies"):
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-6), (a["step"], key)
    assert metrics(tmp_path, "pre")[-1]["rewards/margins"] > 0.1  # it really trained against the reference


def test_precompute_holds_no_reference_model(tmp_path, model_dirs, monkeypatch):
    m = model_dirs("qwen3")
    alive, _ = count_models_during_training(monkeypatch, tmp_path, m, "copy")
    assert len(alive) == 2  # policy + frozen copy: the check sees a reference when there is one
    alive, _ = count_models_during_training(monkeypatch, tmp_path, m, "pre", precompute_ref_log_probs=True)
    assert len(alive) == 1  # the policy alone
    alive, _ = count_models_during_training(monkeypatch, tmp_path, m, "pre-sep", precompute_ref_log_probs=True,
                                            ref_model=str(model_dirs("qwen3", hidden_size=32, head_dim=8)))
    assert len(alive) == 1  # a --ref_model used for the pass is freed before training


def perturbed_copy(src, dst):
    shutil.copytree(src, dst)
    state = load_file(str(dst / "model.safetensors"))
    key = next(k for k in state if "layers.0.mlp" in k)
    state[key] = state[key] + 0.01
    save_file(state, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def test_cache_is_reused_and_rebuilt_on_model_data_or_max_length_change(tmp_path, model_dirs, monkeypatch):
    m = model_dirs("qwen3")
    calls = []
    real = fastdpo.dpo.refcache.compute_table
    monkeypatch.setattr(fastdpo.dpo.reference, "compute_table", lambda *a, **k: calls.append(1) or real(*a, **k))
    cfg = config(tmp_path, m, "c")
    first = precompute_ref(cfg)
    assert not first["reused"] and len(calls) == 1
    again = precompute_ref(cfg)
    assert again == {**first, "reused": True} and len(calls) == 1

    # training finds the cache built ahead of time: no forward pass over the data
    train(TrainConfig(**{**cfg.to_dict(), "precompute_ref_log_probs": True, "max_steps": 2}), progress=False)
    assert len(calls) == 1

    paths = {first["path"]}
    other_model = perturbed_copy(m, tmp_path / "m2")
    changes = [
        dict(model=str(other_model)),
        dict(dataset=[str(write_jsonl(tmp_path / "other.jsonl", easy_rows(48, seed=2)))]),
        dict(max_length=8),  # cuts completions of the longer prompts
    ]
    for change in changes:
        res = precompute_ref(TrainConfig(**{**cfg.to_dict(), **change}))
        assert not res["reused"] and res["path"] not in paths, change
        paths.add(res["path"])
    assert len(calls) == 1 + len(changes)

    # weights rewritten in place (same dir, same names) are noticed too
    perturbed = load_file(str(other_model / "model.safetensors"))
    save_file({k: v * 1.01 for k, v in perturbed.items()}, str(other_model / "model.safetensors"),
              metadata={"format": "pt"})
    res = precompute_ref(TrainConfig(**{**cfg.to_dict(), "model": str(other_model)}))
    assert not res["reused"] and res["path"] not in paths


def test_a_sweep_shares_one_reference_pass(tmp_path, model_dirs, monkeypatch, caplog):
    """Runs that differ only in beta, the loss or the learning rate share one precomputed reference: the first
    computes it, the others reuse it, each saying so in its log, and each certifies it against its starting
    policy."""
    import logging

    caplog.set_level(logging.INFO, logger="fastdpo")
    calls = []
    real = fastdpo.dpo.refcache.compute_table
    monkeypatch.setattr(fastdpo.dpo.reference, "compute_table", lambda *a, **k: calls.append(1) or real(*a, **k))
    base = {**config(tmp_path, model_dirs("qwen3"), "sweep").to_dict(), "precompute_ref_log_probs": True,
            "max_steps": 1}
    sweep = [dict(beta=0.05), dict(beta=0.1), dict(beta=0.3), dict(beta=0.1, loss_type="ipo"),
             dict(beta=0.1, learning_rate=1e-4)]
    for i, change in enumerate(sweep):
        result = train(TrainConfig(**{**base, **change, "output_dir": str(tmp_path / f"run{i}")}), progress=False)
        assert result.summary["certificate"]["status"] == "PASS"
    assert len(calls) == 1
    assert caplog.text.count("Precomputing reference log-probs") == 1
    assert caplog.text.count("Reference log-probs reused from") == len(sweep) - 1


def test_precompute_ref_command(tmp_path, model_dirs, monkeypatch, capsys):
    import fastdpo.cli

    data = write_jsonl(tmp_path / "d.jsonl", easy_rows(16))
    args = ["precompute-ref", "--model", str(model_dirs("qwen3")), "--dataset", str(data), "--ref_cache_dir",
            str(tmp_path / "cache")]
    monkeypatch.setattr(fastdpo.cli, "_setup_logging", lambda console: None)  # leave this process's logging alone
    assert fastdpo.cli.main(args) == 0
    assert "16 pairs computed" in capsys.readouterr().out
    assert fastdpo.cli.main(args) == 0
    assert "16 pairs reused" in capsys.readouterr().out
    assert fastdpo.cli.main(args + ["--loss_type", "simpo"]) == 1
    assert "reference-free: there is nothing to precompute" in capsys.readouterr().out


# ---------------------------------------------------------------- reference-free losses and combinations


@pytest.mark.parametrize("loss,kw", [
    ("simpo", dict(beta=2.0)), ("cpo", dict(beta=0.5)), ("orpo", dict(orpo_alpha=1.0)),
])
def test_reference_free_losses_learn_without_a_reference(tmp_path, model_dirs, monkeypatch, loss, kw):
    alive, result = count_models_during_training(monkeypatch, tmp_path, model_dirs("qwen3"), loss, max_steps=10,
                                                 rows=long_chosen_rows(48, seed=1), loss_type=loss,
                                                 learning_rate=3e-3, **kw)
    assert result["reference"] == "none" and len(alive) == 1
    rows = metrics(tmp_path, loss)
    if loss == "cpo":  # rewards of summed log-probs: the longer answer starts out less likely
        assert rows[0]["rewards/accuracies"] <= 0.5
    # SimPO and ORPO log beta x per-token mean log-probs, as TRL does: the margin between the answers grows
    assert rows[-1]["rewards/margins"] > rows[0]["rewards/margins"]
    assert rows[-1]["rewards/accuracies"] >= 0.9


def test_combination_learns(tmp_path, model_dirs):
    run(tmp_path, model_dirs("llama"), "mpo", loss_type="sigmoid,sft", loss_weights="1,0.1", beta=0.5, max_steps=10,
        learning_rate=3e-3)
    rows = metrics(tmp_path, "mpo")
    assert rows[-1]["rewards/accuracies"] >= 0.9
    assert rows[-1]["logps/chosen"] > rows[0]["logps/chosen"]  # the NLL term raises chosen


def test_ld_dpo_and_wpo_train(tmp_path, model_dirs):
    run(tmp_path, model_dirs("qwen3"), "ldwpo", ld_alpha=0.5, use_weighting=True, beta=0.5, max_steps=10,
        learning_rate=3e-3)
    rows = metrics(tmp_path, "ldwpo")
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in rows)
    assert rows[-1]["rewards/accuracies"] >= 0.9


@pytest.mark.parametrize("loss", ["aot", "aot_unpaired"])
def test_step_sorting_losses_do_not_depend_on_micro_batching(tmp_path, model_dirs, loss):
    m = model_dirs("qwen3")
    kw = dict(loss_type=loss, adam_epsilon=1e-6, label_smoothing=0.05, max_steps=4)
    a = weights(run(tmp_path, m, "a", per_device_train_batch_size=8, **kw))
    b = weights(run(tmp_path, m, "b", per_device_train_batch_size=2, gradient_accumulation_steps=4,
                    max_tokens_per_batch=40, **kw))
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=1e-5, msg=k)


# ---------------------------------------------------------------- TR-DPO


def test_sync_mixes_weights_by_hand():
    policy, ref = torch.nn.Linear(2, 2, bias=False), torch.nn.Linear(2, 2, bias=False)
    with torch.no_grad():
        policy.weight.fill_(1.0)
        ref.weight.fill_(3.0)
    Reference("copy", ref).sync(policy, 0.6)
    assert torch.equal(ref.weight, torch.full((2, 2), 0.6 * 1.0 + 0.4 * 3.0))


def test_tr_dpo_syncs_the_reference(tmp_path, model_dirs):
    m = model_dirs("qwen3")
    run(tmp_path, m, "nosync", max_steps=4)
    run(tmp_path, m, "every", max_steps=4, sync_ref_model=True, ref_model_mixup_alpha=1.0, ref_model_sync_steps=1)
    run(tmp_path, m, "second", max_steps=4, sync_ref_model=True, ref_model_mixup_alpha=1.0, ref_model_sync_steps=2)
    chosen = lambda name: [r["rewards/chosen"] for r in metrics(tmp_path, name)]
    assert all(abs(v) > 1e-4 for v in chosen("nosync")[1:])
    assert chosen("every") == [0.0] * 4  # alpha 1: the reference is the policy of the step before
    second = chosen("second")
    assert second[2] == 0.0 and abs(second[1]) > 1e-4 and abs(second[3]) > 1e-4


def test_tr_dpo_resume_is_exact(tmp_path, model_dirs):
    m = model_dirs("qwen3")
    kw = dict(sync_ref_model=True, ref_model_mixup_alpha=0.6, ref_model_sync_steps=2, max_steps=6)
    full = weights(run(tmp_path, m, "full", **kw))
    run(tmp_path, m, "part", save_steps=3, **kw)
    resumed = run(tmp_path, m, "resumed", resume_from_checkpoint=str(tmp_path / "part" / "checkpoint-3"), **kw)
    got = weights(resumed)
    for k in full:
        assert torch.equal(full[k], got[k]), k


# ---------------------------------------------------------------- adaptive beta


def test_adaptive_beta_is_lowered_bounded_and_resumed(tmp_path, model_dirs):
    m = model_dirs("qwen3")
    kw = dict(beta=0.4, beta_schedule="kl_adaptive", beta_kl_window=2, beta_min_ratio=0.85, learning_rate=3e-3)
    run(tmp_path, m, "low", beta_kl_target=0.0, **kw)
    run(tmp_path, m, "high", beta_kl_target=100.0, **kw)
    low = [r["beta"] for r in metrics(tmp_path, "low")]
    # step 1 has no drift yet (policy = reference), then beta falls with the drift until it rests on the floor
    assert low[:2] == [pytest.approx(0.4)] * 2
    assert 0.4 > low[2] > low[3] > 0.34 + 1e-6 and low[-1] == pytest.approx(0.34)
    assert min(low) >= 0.34 - 1e-6
    assert [r["beta"] for r in metrics(tmp_path, "high")] == [pytest.approx(0.4)] * 6
    # resume restores the running mean: betas and losses match the uninterrupted run
    run(tmp_path, m, "part", beta_kl_target=0.0, save_steps=3, **kw)
    run(tmp_path, m, "resumed", beta_kl_target=0.0, resume_from_checkpoint=str(tmp_path / "part" / "checkpoint-3"),
        **kw)
    tail = metrics(tmp_path, "low")[3:]
    assert [(r["beta"], r["loss"]) for r in metrics(tmp_path, "resumed")] == [(r["beta"], r["loss"]) for r in tail]


# ---------------------------------------------------------------- --ref_adapters


@pytest.fixture(scope="module")
def adapter(model_dirs, tmp_path_factory):
    """A LoRA adapter with random (non-zero) weights on the llama tiny model."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(model_dirs("llama"))
    cfg = LoraConfig(r=4, lora_alpha=16, target_modules="all-linear", init_lora_weights=False, task_type="CAUSAL_LM")
    out = tmp_path_factory.mktemp("adapter")
    get_peft_model(base, cfg).save_pretrained(out)
    return out


def base_plus_adapter_logps(model_dir, adapter_dir, batch, backend):
    from peft import PeftModel

    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir), str(adapter_dir)).eval()
    prepare_packed(model, backend)
    with torch.no_grad():
        return completion_logps(model, batch, backend).sums


def first_batch(s):
    return pack_pairs(s.pairs[:6])


@pytest.mark.parametrize("train_type,strategy", [("lora", "ref_adapter"), ("full", "separate")])
def test_ref_adapters_is_the_reference(tmp_path, model_dirs, adapter, train_type, strategy):
    m = model_dirs("llama")
    s = build_setup(config(tmp_path, m, "s", train_type=train_type, ref_adapters=str(adapter)))
    assert s.reference.strategy == strategy
    batch, backend = first_batch(s), Backend("dense")
    trainable = {n for n, p in s.model.named_parameters() if p.requires_grad}
    got = s.reference.logps(s.model, batch, backend).sums
    torch.testing.assert_close(got, base_plus_adapter_logps(m, adapter, batch, backend), rtol=1e-5, atol=1e-5)
    assert {n for n, p in s.model.named_parameters() if p.requires_grad} == trainable
    assert not any(".ref." in n for n in trainable)  # the reference adapter is never trained
    # the policy is not the reference: it starts from the base model (a fresh LoRA adds nothing)
    base = AutoModelForCausalLM.from_pretrained(m).eval()
    prepare_packed(base, backend)
    with torch.no_grad():
        torch.testing.assert_close(completion_logps(s.model, batch, backend).sums,
                                   completion_logps(base, batch, backend).sums, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("train_type", ["full", "lora"])
def test_precomputed_ref_adapters_leave_the_policy_unchanged(tmp_path, model_dirs, adapter, train_type):
    m = model_dirs("llama")
    s = build_setup(config(tmp_path, m, "s", ref_adapters=str(adapter), precompute_ref_log_probs=True,
                           train_type=train_type))
    assert s.reference.strategy == "precompute"
    batch, backend = first_batch(s), Backend("dense")
    torch.testing.assert_close(s.reference.logps(s.model, batch, backend).sums,
                               base_plus_adapter_logps(m, adapter, batch, backend), rtol=1e-5, atol=1e-5)
    # the adapter used for the pass is gone: the policy is the base model (plus a fresh, zero-effect LoRA)
    lora = [n for n, _ in s.model.named_parameters() if "lora" in n]
    assert (not lora) if train_type == "full" else all(".default." in n for n in lora)
    base = AutoModelForCausalLM.from_pretrained(m).eval()
    prepare_packed(base, backend)
    with torch.no_grad():
        torch.testing.assert_close(completion_logps(s.model, batch, backend).sums,
                                   completion_logps(base, batch, backend).sums, rtol=1e-5, atol=1e-5)


def test_continue_an_adapter_against_itself(tmp_path, model_dirs, adapter):
    """ms-swift's `--adapters sft --ref_adapters sft`: policy and reference start equal, only the policy moves."""
    from peft import PeftModel

    m = model_dirs("llama")
    result = run(tmp_path, m, "cont", train_type="lora", adapters=str(adapter), ref_adapters=str(adapter),
                 learning_rate=5e-3)
    rows = metrics(tmp_path, "cont")
    assert rows[0]["rewards/margins"] == 0.0 and rows[0]["loss"] == pytest.approx(0.6931472)
    assert rows[-1]["rewards/margins"] > 0
    final = result["final_dir"]
    assert not (tmp_path / "cont" / "final" / "ref").exists()  # only the trained adapter is saved
    PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(m), final)  # loads as a plain adapter
    start = load_file(str(adapter / "adapter_model.safetensors"))
    moved = load_file(f"{final}/adapter_model.safetensors")
    assert start.keys() == moved.keys() and any(not torch.equal(start[k], moved[k]) for k in start)


def test_in_memory_model_precomputes_without_cache(tmp_path, model_dirs):
    """`assemble` without rows (a model built in memory, as `fastdpo bench` does): computed, never cached."""
    from fastdpo.model.load import load_tokenizer
    from fastdpo.training.setup import assemble, load_data

    m = model_dirs("qwen3")
    cfg = config(tmp_path, m, "mem", precompute_ref_log_probs=True)
    tokenizer = load_tokenizer(str(m))
    _, pairs = load_data(cfg, tokenizer)
    s = assemble(cfg, torch.device("cpu"), AutoModelForCausalLM.from_pretrained(m), tokenizer, pairs)
    assert s.reference.strategy == "precompute"
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").glob("*.safetensors"))
    batch = first_batch(s)
    online = build_setup(config(tmp_path, m, "online"))
    torch.testing.assert_close(s.reference.logps(s.model, batch, Backend("dense")).sums,
                               online.reference.logps(online.model, batch, Backend("dense")).sums)


def test_precompute_on_flex_without_a_budget_sizes_one_as_training_does(tmp_path, model_dirs, monkeypatch):
    """`fastdpo precompute` without --max_tokens_per_batch on FlexAttention cuts its (no-grad) micro-batches under
    four times the budget training would pick, so its kernels see a few static lengths, not one per batch."""
    import fastdpo.commands.precompute
    from fastdpo.model.backend import Backend, flex_budget

    seen = {}

    class Scored(Exception):
        pass

    def capture(model, pairs, backend, pad_id, device, batch_pairs, budget):
        seen.update(pairs=pairs, budget=budget)
        raise Scored

    monkeypatch.setattr(fastdpo.commands.precompute, "choose_backend", lambda *a, **k: Backend("flex"))
    monkeypatch.setattr(fastdpo.dpo.reference, "prepare_packed", lambda *a, **k: None)
    monkeypatch.setattr(fastdpo.dpo.reference, "compute_table", capture)
    cfg = config(tmp_path, model_dirs("qwen3"), "c")
    with pytest.raises(Scored):
        precompute_ref(cfg)
    assert seen["budget"] == 4 * flex_budget(seen["pairs"], cfg.per_device_train_batch_size) > 0
    with pytest.raises(Scored):
        precompute_ref(TrainConfig(**{**cfg.to_dict(), "max_tokens_per_batch": 512}))
    assert seen["budget"] == 4 * 512


def test_the_cache_key_tells_fp8_products_and_their_recipe_apart(tmp_path, model_dirs):
    """A table computed by a policy with FP8 products (--fp8) is another table than the bf16 policy's, and the two
    scaling recipes' tables differ too; a --ref_model keeps its own precision, so its key does not change."""
    from fastdpo.dpo.reference import cache_path
    from fastdpo.model.load import load_tokenizer
    from fastdpo.training.setup import load_data

    cfg = config(tmp_path, model_dirs("qwen3"), "k")
    rows, pairs = load_data(cfg, load_tokenizer(cfg.model))

    def key(**kw):
        return cache_path(TrainConfig(**{**cfg.to_dict(), **kw}), pairs, rows)[0]

    plain, row, tensor = key(), key(fp8=True), key(fp8=True, fp8_recipe="tensorwise")
    assert len({plain, row, tensor}) == 3
    ref = str(model_dirs("llama"))
    assert key(ref_model=ref) == key(ref_model=ref, fp8=True)
