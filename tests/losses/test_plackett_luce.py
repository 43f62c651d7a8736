"""Plackett-Luce in training: rows of scored completions read as rankings, one step against a plain float32
reference (each completion its own unpacked forward with full logits, the likelihood written out), and on plain
pairs the same step as sigmoid DPO; rows that are no ranking are refused."""

import math

import pytest
import torch
from model_helpers import WORDS

from fastdpo.config import TrainConfig
from fastdpo.data.columns import RowOptions
from fastdpo.data.formats import RowError, to_row
from fastdpo.data.groups import Pairing, to_rows
from fastdpo.data.rankings import rankings
from fastdpo.data.tokenize import TokenizeOptions, tokenize_rows
from fastdpo.errors import FastDPOError
from fastdpo.model.tiny import build_tiny_model

RANKED = [  # 4, 3 and 2 completions; a second record with the first one's prompt (one group, two rankings)
    {"prompt": "w1 w2 w3", "completions": [" w5 w6", " w7", " w8 w9 w10", " w11"], "scores": [0.5, 2.0, -1.0, 1.0]},
    {"prompt": "w20", "completions": [" w21 w22", " w23", " w24 w25"], "ranks": [2, 1, 3]},
    {"prompt": "w1 w2 w3", "completions": [" w30", " w31 w32"], "scores": [1, 3]},
]
RANKING = Pairing("ranking")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("pl-models")
    return build_tiny_model(root / "policy", "qwen3", WORDS, seed=0), build_tiny_model(root / "ref", "qwen3", WORDS,
                                                                                        seed=1)


def ranked_pairs(tok, records):
    rows = [row for i, r in enumerate(records) for row in to_rows(r, f"d:{i}", pairing=RANKING)]
    pairs, _ = tokenize_rows(tok, rows, options=TokenizeOptions())
    return rankings(pairs, rows)[0]


def one_step(models, pairs, tok, tmp_path, name, **kw):
    from fastdpo.model.load import load_model
    from fastdpo.training.setup import assemble
    from fastdpo.training.trainer import Trainer

    cfg = TrainConfig(model=str(models[0]), dataset=["unused"], output_dir=str(tmp_path / name), shuffle=False,
                      max_grad_norm=0.0, learning_rate=1e-3, **kw)
    device = torch.device("cpu")
    s = assemble(cfg, device, load_model(str(models[0]), torch.float32, device), tok, pairs,
                 ref_model=load_model(str(models[1]), torch.float32, device))
    grads = {}
    for n, q in s.model.named_parameters():
        q.register_post_accumulate_grad_hook(lambda q, n=n: grads.__setitem__(n, q.grad.clone()))
    result = Trainer(cfg, s).step()
    return result, grads


def completion_logp(model, prompt, completion):
    """log p(completion | prompt): one unpadded forward, full-vocabulary log_softmax in float32."""
    ids = torch.tensor([prompt + completion])
    logp = torch.log_softmax(model(ids).logits.float()[0, :-1], -1)
    at = torch.arange(len(prompt) - 1, len(prompt) + len(completion) - 1)
    return logp[at, ids[0, at + 1]].sum()


@pytest.mark.parametrize("layout", [{}, {"padding_free": False}, {"per_device_train_batch_size": 1,
                                                                      "gradient_accumulation_steps": 3}])
def test_a_step_on_rankings_equals_the_likelihood_written_out(tmp_path, models, one_thread, layout):
    from transformers import AutoModelForCausalLM

    from fastdpo.model.load import load_tokenizer

    tok = load_tokenizer(str(models[0]))
    pairs = ranked_pairs(tok, RANKED)
    assert [p.chunk for p in pairs] == [0, 0, 0, 1, 1, 2]  # 3 rankings of 3, 2 and 1 adjacent pairs
    beta = 0.5
    kw = {"per_device_train_batch_size": 3, **layout}
    result, grads = one_step(models, pairs, tok, tmp_path, "ours", loss_type="plackett_luce", beta=beta, **kw)

    policy = AutoModelForCausalLM.from_pretrained(models[0], dtype=torch.float32)
    ref = AutoModelForCausalLM.from_pretrained(models[1], dtype=torch.float32)
    total, at = 0.0, 0
    for n in (3, 2, 1):
        chain = pairs[at: at + n]
        completions = [p.chosen for p in chain] + [chain[-1].rejected]  # best first
        prompt = chain[0].prompt
        with torch.no_grad():
            ref_lp = [completion_logp(ref, prompt, c) for c in completions]
        r = [beta * (completion_logp(policy, prompt, c) - q) for c, q in zip(completions, ref_lp)]
        total = total - sum(r[k] - torch.logsumexp(torch.stack(r[k:]), 0) for k in range(len(r)))
        at += n
    loss = total / 3  # the step's mean over its rankings
    loss.backward()
    assert result.metrics.finish()["loss"] == pytest.approx(float(loss), rel=1e-5)
    for name, q in policy.named_parameters():
        torch.testing.assert_close(grads[name], q.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_on_pairs_a_step_is_sigmoid_dpo(tmp_path, models, one_thread):
    """Plain pairs are rankings of two: loss, every metric and every gradient equal sigmoid DPO's."""
    from data_helpers import easy_rows

    from fastdpo.model.load import load_tokenizer

    tok = load_tokenizer(str(models[0]))
    rows = [to_row(r, f"d:{i}") for i, r in enumerate(easy_rows(6, seed=3))]
    pairs, _ = tokenize_rows(tok, rows, options=TokenizeOptions())
    pl, pl_grads = one_step(models, rankings(pairs, rows)[0], tok, tmp_path, "pl", loss_type="plackett_luce",
                            per_device_train_batch_size=2, gradient_accumulation_steps=3)
    dpo, dpo_grads = one_step(models, pairs, tok, tmp_path, "dpo", per_device_train_batch_size=2,
                              gradient_accumulation_steps=3)
    a, b = pl.metrics.finish(), dpo.metrics.finish()
    for name in ("loss", "rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies",
                 "logps/chosen", "logps/rejected"):
        assert a[name] == pytest.approx(b[name], rel=1e-5, abs=1e-7), name
    for name, g in dpo_grads.items():
        torch.testing.assert_close(pl_grads[name], g, rtol=1e-5, atol=1e-7, msg=name)


def test_rows_that_are_no_ranking_are_refused():
    tied = {"prompt": "w1", "completions": ["w2", "w3", "w4"], "scores": [1.0, 2.0, 1.0]}
    with pytest.raises(RowError, match=r"d:0: field 'scores' has tied values: a ranking .* needs a strict order"):
        to_rows(tied, "d:0", pairing=RANKING)
    # a list of rejected replies orders chosen above each, not the rejected among themselves
    from fastdpo.model.tiny import word_tokenizer

    tok = word_tokenizer(WORDS)
    row = {"prompt": "w1", "chosen": " w2", "rejected": [" w3", " w4"]}
    rows = to_rows(row, "d:7", pairing=RANKING)
    pairs, _ = tokenize_rows(tok, rows, options=TokenizeOptions())
    with pytest.raises(FastDPOError, match="d:7: its pairs are not one ranking"):
        rankings(pairs, rows)


def test_a_ranking_cut_by_the_length_limits_is_left_out():
    from fastdpo.model.tiny import word_tokenizer

    tok = word_tokenizer(WORDS)
    records = [{"prompt": "w1", "completions": [" w2", " w3 w4 w5 w6 w7 w8", " w9"], "scores": [3, 2, 1]},
               {"prompt": "w1", "completions": [" w2", " w9"], "scores": [3, 2]}]
    rows = [row for i, r in enumerate(records) for row in to_rows(r, f"d:{i}", pairing=RANKING)]
    pairs, _ = tokenize_rows(tok, rows, options=TokenizeOptions(max_length=6, truncation_strategy="delete"))
    kept, left_out = rankings(pairs, rows)
    assert left_out == 1 and len(kept) == 1 and kept[0].chunk == 0


def test_plackett_luce_reads_scored_rows_as_rankings():
    cfg = TrainConfig(model="m", dataset=["d"], loss_type="plackett_luce", pairing="best_vs_rest")
    assert RowOptions.from_config(cfg).pairing.rule == "ranking"
    with pytest.raises(FastDPOError, match="plackett_luce trains on rankings and cannot be combined"):
        TrainConfig(model="m", dataset=["d"], loss_type="plackett_luce,sft").validate_loss()
    assert math.isclose(TrainConfig(model="m", dataset=["d"]).beta, 0.1)
