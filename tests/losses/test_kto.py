"""KTO and apo_zero_unpaired against TRL 1.16's own KTOTrainer (skipped without TRL; the test extra installs it): the
prepared rows (prompt, completion and KL completion ids), one optimizer step's loss, every metric TRL logs and every
gradient, in float32; with one KL chunk, several, a partial last chunk, non-unit weights, paired rows unpaired as
TRL unpairs them, and a token budget and grouping that change how the step is packed but not what it computes."""

import importlib.util

import pytest
import torch
from model_helpers import WORDS

from fastdpo.config import TrainConfig
from fastdpo.data.formats import Row
from fastdpo.data.groups import to_rows
from fastdpo.data.kto import kl_completions, unpair_rows
from fastdpo.data.tokenize import TokenizeOptions, tokenize_rows
from fastdpo.model.tiny import build_tiny_model

pytestmark = pytest.mark.skipif(importlib.util.find_spec("trl") is None, reason="TRL is not installed")

# prompts repeat (grouping has work to do) and differ in length; labels mixed, one chunk all desirable at B = 2
UNPAIRED = [
    {"prompt": "w1 w2", "completion": " w5 w6", "label": True},
    {"prompt": "w1 w2", "completion": " w7 w8 w9", "label": False},
    {"prompt": "w11 w12 w13 w14", "completion": " w15", "label": True},
    {"prompt": "w20", "completion": " w21 w22 w23 w24", "label": True},
    {"prompt": "w1 w2", "completion": " w30 w31", "label": False},
    {"prompt": "w33 w34 w35", "completion": " w36 w37", "label": False},
    {"prompt": "w40 w41", "completion": " w42", "label": True},
    {"prompt": "w11 w12 w13 w14", "completion": " w43 w44 w45", "label": False},
    {"prompt": "w46", "completion": " w47 w48", "label": True},
    {"prompt": "w49 w50 w51", "completion": " w52", "label": False},
]
PAIRED = [{"prompt": r["prompt"], "chosen": r["completion"], "rejected": s["completion"]}
          for r, s in zip(UNPAIRED[::2], UNPAIRED[1::2])]
METRICS = ("loss", "kl", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A tiny policy and a reference of other random weights (equal weights would make every estimate zero)."""
    root = tmp_path_factory.mktemp("kto-models")
    return build_tiny_model(root / "policy", "qwen3", WORDS, seed=0), build_tiny_model(root / "ref", "qwen3", WORDS,
                                                                                        seed=1)


def trl_kto_step(models, rows, out, batch, accumulation, **kw):
    """One optimizer step of TRL's KTOTrainer: its prepared rows, logged metrics and accumulated gradients."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, TrainerCallback
    from trl import KTOConfig, KTOTrainer

    from fastdpo.model.load import load_tokenizer

    policy = AutoModelForCausalLM.from_pretrained(models[0], dtype=torch.float32)
    ref = AutoModelForCausalLM.from_pretrained(models[1], dtype=torch.float32)
    logs = []

    class Keep(TrainerCallback):
        def on_log(self, args, state, control, logs_=None, **k):
            logs.append(dict(k.get("logs") or logs_ or {}))

    args = KTOConfig(output_dir=str(out), report_to=[], use_cpu=True, bf16=False, max_steps=1, logging_steps=1,
                     per_device_train_batch_size=batch, gradient_accumulation_steps=accumulation, learning_rate=1e-3,
                     max_grad_norm=0.0, gradient_checkpointing=False, save_strategy="no", **kw)
    trainer = KTOTrainer(model=policy, ref_model=ref, args=args, train_dataset=Dataset.from_list(rows),
                         processing_class=load_tokenizer(str(models[0])), callbacks=[Keep()])
    data = list(trainer.train_dataset)
    grads = {}
    for name, q in policy.named_parameters():
        q.register_post_accumulate_grad_hook(lambda q, name=name: grads.__setitem__(name, q.grad.clone()))
    trainer.train()
    logged = next(entry for entry in logs if "loss" in entry)
    return data, logged, grads


def our_step(models, rows, out, batch, accumulation, kto_kw, **cfg_kw):
    """The same step in fastdpo: rows read, unpaired and tokenised as training reads them, one Trainer step."""
    from fastdpo.model.load import load_model, load_tokenizer
    from fastdpo.training.evaluate import TrainingEval
    from fastdpo.training.setup import assemble
    from fastdpo.training.trainer import Trainer

    tok = load_tokenizer(str(models[0]))
    kto_kw = {"loss_type": "kto", **kto_kw}
    loss = kto_kw["loss_type"]
    read = [row for i, r in enumerate(rows) for row in to_rows(r, f"d:{i}")]  # as training reads a file's rows
    pairs, _ = tokenize_rows(tok, unpair_rows(read), options=TokenizeOptions(max_length=kto_kw.get("max_length", 1024)))
    pairs = kl_completions(pairs, batch, kto_kw.get("max_length", 1024), with_kl=loss == "kto")
    cfg = TrainConfig(model=str(models[0]), dataset=["unused"], output_dir=str(out), per_device_train_batch_size=batch,
                      gradient_accumulation_steps=accumulation, learning_rate=1e-3, max_grad_norm=0.0, **kto_kw,
                      **cfg_kw)
    device = torch.device("cpu")
    s = assemble(cfg, device, load_model(str(models[0]), torch.float32, device), tok, pairs,
                 ref_model=load_model(str(models[1]), torch.float32, device))
    trainer = Trainer(cfg, s)
    trainer.held_out = TrainingEval(cfg, pairs).run(s, 0, 0.0)  # before the step: the weights TRL's metrics saw
    grads = {}
    for name, q in s.model.named_parameters():
        q.register_post_accumulate_grad_hook(lambda q, name=name: grads.__setitem__(name, q.grad.clone()))
    result = trainer.step()
    result.held_out = trainer.held_out
    return pairs, result, grads


CASES = {  # rows, per_device_train_batch_size, gradient_accumulation_steps, KTO settings
    "one chunk": (UNPAIRED[:8], 8, 1, {}),
    "several chunks": (UNPAIRED[:8], 2, 4, {}),
    "partial last chunk, weights": (UNPAIRED, 4, 3, {"desirable_weight": 1.5, "undesirable_weight": 0.7}),
    "apo_zero_unpaired": (UNPAIRED[:8], 4, 2, {"loss_type": "apo_zero_unpaired", "beta": 0.3}),
    "paired rows": (PAIRED, 3, 4, {}),
    "max_length cuts": (UNPAIRED[:8], 4, 2, {"max_length": 5}),
}


# every case packed with grouping; two of them also in the padded layout, cut by a token budget without grouping, and
# with the reference's log-probs (the KL completions' too) precomputed before the step
RUNS = [(case, "grouped") for case in CASES] + [(case, layout) for case in ("several chunks", "partial last chunk, "
                                                "weights") for layout in ("padded", "budget", "precomputed")]


@pytest.mark.parametrize("case,layout", RUNS)
def test_kto_equals_trl_kto_trainer(tmp_path, models, one_thread, case, layout):
    rows, batch, accumulation, kw = CASES[case]
    trl_data, trl_logged, trl_grads = trl_kto_step(models, rows, tmp_path / "trl", batch, accumulation, **kw)
    cfg_kw = {"grouped": {}, "padded": {"padding_free": False},
              "budget": {"group_prompts": False, "max_tokens_per_batch": 16},
              "precomputed": {"precompute_ref_log_probs": True, "ref_cache_dir": str(tmp_path / "cache")}}[layout]
    pairs, result, grads = our_step(models, rows, tmp_path / "ours", batch, accumulation, kw, **cfg_kw)
    # the rows as TRL prepares them: its unpairing order, its tokenisation, its KL completions
    assert [(p.prompt, p.chosen, p.label) for p in pairs] == [
        (r["prompt_ids"], r["completion_ids"][: kw.get("max_length", 1024) - len(r["prompt_ids"])], r["label"])
        for r in trl_data]
    if kw.get("loss_type", "kto") == "kto":
        assert [p.rejected for p in pairs] == [
            r["KL_completion_ids"][: kw.get("max_length", 1024) - len(r["prompt_ids"])] for r in trl_data]
    assert result.metrics.micro_batches == -(-len(pairs) // batch)
    logged = result.metrics.finish()
    for name in METRICS:
        assert logged[name] == pytest.approx(trl_logged[name], rel=1e-4, abs=1e-6), name
        # evaluation scores the same rows with the step's arithmetic (each chunk where the step has a micro-batch)
        assert result.held_out[f"eval_{name}"] == pytest.approx(trl_logged[name], rel=1e-4, abs=1e-6), name
    assert trl_grads.keys() == grads.keys()
    for name, g in trl_grads.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-4, atol=1e-6, msg=name)


def test_kl_estimate_is_clamped_per_chunk(tmp_path, models, one_thread):
    """Swapping policy and reference flips the sign of the raw KL estimate: some chunk must clamp at 0, and the
    step still equals TRL's (the clamp is per chunk, not over the step)."""
    swapped = (models[1], models[0])
    rows, batch, accumulation, _ = CASES["several chunks"]
    _, trl_logged, _ = trl_kto_step(swapped, rows, tmp_path / "trl", batch, accumulation)
    _, result, _ = our_step(swapped, rows, tmp_path / "ours", batch, accumulation, {})
    _, plain, _ = our_step(models, rows, tmp_path / "plain", batch, accumulation, {})
    logged = result.metrics.finish()
    assert logged["kl"] == pytest.approx(trl_logged["kl"], rel=1e-4, abs=1e-6)
    assert logged["loss"] == pytest.approx(trl_logged["loss"], rel=1e-4, abs=1e-6)
    assert min(logged["kl"], plain.metrics.finish()["kl"]) < max(logged["kl"], plain.metrics.finish()["kl"])


def test_kl_rotation_within_chunks():
    """Row i of a chunk takes row i-1's completion, the first takes the last's, a chunk of one keeps its own; the
    KL completion is cut to fit after the row's own prompt."""
    from fastdpo.data.tokenize import TokenizedPair

    pairs = [TokenizedPair([1] * (i + 1), [10 + i] * 3, [10 + i] * 3, i, label=True) for i in range(5)]
    got = kl_completions(pairs, 2, max_length=6)
    assert [p.rejected for p in got] == [[11] * 3, [10] * 3, [13] * 3, [12] * 2, [14]]
    assert [p.chunk for p in got] == [0, 0, 1, 1, 2]
    assert [p.chosen for p in got] == [p.chosen for p in pairs]
    assert [p.rejected for p in kl_completions(pairs, 2, 0, with_kl=False)] == [p.chosen for p in pairs]


def test_unpairing_follows_trl_blocks():
    """TRL unpairs with a batched map of 1000 rows: each block's chosen rows, then its rejected rows."""
    rows = [Row("p", f"c{i}", f"r{i}", f"d:{i}") for i in range(1500)]
    out = unpair_rows(rows)
    assert [r.chosen for r in out[:2]] == ["c0", "c1"] and out[999].chosen == "c999" and out[1000].chosen == "r0"
    assert out[2000].chosen == "c1000" and out[2500].chosen == "r1000" and len(out) == 3000
    assert [r.label for r in out[998:1002]] == [True, True, False, False]
    assert all(r.rejected == r.chosen for r in out)


def test_conversational_rows_equal_trl(tmp_path, one_thread):
    """Conversational unpaired rows go through the chat template as TRL renders them (the prompt with the generation
    prompt, then prompt + completion): the same token ids, KL completions, loss and metrics as TRL's KTOTrainer."""
    from data_helpers import chat_tokenizer
    from transformers import AutoModelForCausalLM

    from fastdpo.model.tiny import tiny_config

    tok = chat_tokenizer()
    dirs = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(tiny_config("qwen3", len(tok)), dtype=torch.float32)
        model.save_pretrained(tmp_path / f"m{seed}")
        tok.save_pretrained(tmp_path / f"m{seed}")
        dirs.append(tmp_path / f"m{seed}")
    rows = [{"prompt": [{"role": "user", "content": r["prompt"]}],
             "completion": [{"role": "assistant", "content": r["completion"].strip()}], "label": r["label"]}
            for r in UNPAIRED[:8]]
    trl_data, trl_logged, trl_grads = trl_kto_step(dirs, rows, tmp_path / "trl", 4, 2)
    read = [row for i, r in enumerate(rows) for row in to_rows(r, f"d:{i}")]
    assert {row.format for row in read} == {"unpaired_conversational"}
    pairs, _ = tokenize_rows(tok, read, options=TokenizeOptions(max_length=1024))
    pairs = kl_completions(pairs, 4, 1024)
    assert [(p.prompt, p.chosen, p.rejected) for p in pairs] == [
        (r["prompt_ids"], r["completion_ids"], r["KL_completion_ids"]) for r in trl_data]
    _, result, grads = our_step(dirs, rows, tmp_path / "ours", 4, 2, {})
    logged = result.metrics.finish()
    for name in METRICS:
        assert logged[name] == pytest.approx(trl_logged[name], rel=1e-4, abs=1e-6), name
    for name, g in trl_grads.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-4, atol=1e-6, msg=name)
