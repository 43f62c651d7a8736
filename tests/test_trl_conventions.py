"""Conventions a user coming from TRL meets, each compared with TRL 1.16's own code (skipped without TRL; the test
extra installs it): SimPO/ORPO log per-token mean log-probs and beta x mean rewards (CPO sums, as TRL); TRL's
sigmoid ignores --label_smoothing, which a TRL command is told; a prefilled assistant turn is rendered as TRL renders
it, scoring only the reply; --truncation_mode keep_start/keep_end with TRL's meaning; ORPO's NLL covers the chosen
completion, where TRL's ORPOTrainer also counts the prompt (the documented difference, measured)."""

import importlib.util
import logging
from types import SimpleNamespace

import pytest
import torch
from data_helpers import assistant, chat_tokenizer, user

from fastdpo.cli import build_parser
from fastdpo.config import TrainConfig, build_config, mean_logp_rewards
from fastdpo.dpo.losses import LOSSES, LossParams, loss_inputs
from fastdpo.model.seqlogps import summarise
from fastdpo.observe.metrics import StepMetrics
from fastdpo.training.evaluate import preference_metrics

pytestmark = pytest.mark.skipif(importlib.util.find_spec("trl") is None, reason="TRL is not installed")
CPU = SimpleNamespace(device=torch.device("cpu"), gather_for_metrics=lambda x: x)


def padded_logits(b=6, seed=0, vocab=11):
    """Random logits and TRL's labels (-100 over prompt and padding) for B chosen then B rejected sequences whose
    lengths differ a lot, so that sums and per-token means rank pairs differently."""
    g = torch.Generator().manual_seed(seed)
    plen = torch.randint(1, 4, (b,), generator=g)
    clen = torch.cat([torch.randint(1, 3, (b,), generator=g), torch.randint(6, 10, (b,), generator=g)])
    width = int((plen.repeat(2) + clen).max())
    logits = torch.randn(2 * b, width, vocab, generator=g, dtype=torch.float64) * 2
    labels = torch.full((2 * b, width), -100)
    for r in range(2 * b):
        p, c = int(plen[r % b]), int(clen[r])
        labels[r, p: p + c] = torch.randint(0, vocab, (c,), generator=g)
    return logits, labels


def our_inputs(logits, labels):
    """Our per-token log-probs of the same targets, summarised per sequence."""
    lab, lg = labels[:, 1:], logits[:, :-1]
    mask = lab != -100
    tok = torch.log_softmax(lg, -1).gather(-1, lab.clamp(min=0)[..., None])[..., 0]
    rows, cols = mask.nonzero(as_tuple=True)
    lengths = mask.sum(1)
    return loss_inputs(summarise(tok[rows, cols].float(), rows, lengths), None, lengths)


@pytest.mark.parametrize("loss", ["simpo", "cpo", "orpo"])
def test_reference_free_losses_log_as_trl(loss):
    from trl.experimental.cpo import CPOTrainer
    from trl.experimental.orpo import ORPOTrainer

    logits, labels = padded_logits()
    b, beta = labels.shape[0] // 2, 0.7
    mean = loss in ("simpo", "orpo")  # TRL averages over tokens for simpo (and ipo) and for ORPO; CPO sums
    logps = (ORPOTrainer if loss == "orpo" else CPOTrainer).get_batch_logps(logits, labels, average_log_prob=mean)
    if loss == "orpo":
        fake = SimpleNamespace(beta=beta, accelerator=CPU)
        _, trl_c, trl_r, _, _ = ORPOTrainer.odds_ratio_loss(fake, logps[:b], logps[b:])
    else:
        fake = SimpleNamespace(alpha=0.0, beta=beta, label_smoothing=0.0, simpo_gamma=0.5, accelerator=CPU,
                               loss_type="simpo" if loss == "simpo" else "sigmoid")
        _, trl_c, trl_r = CPOTrainer.cpo_loss(fake, logps[:b], logps[b:])
    trl = {"rewards/chosen": trl_c.mean(), "rewards/rejected": trl_r.mean(), "rewards/margins": (trl_c - trl_r).mean(),
           "rewards/accuracies": (trl_c > trl_r).float().mean(), "logps/chosen": logps[:b].mean(),
           "logps/rejected": logps[b:].mean()}
    x = our_inputs(logits, labels)
    assert mean_logp_rewards([loss]) == mean
    step = StepMetrics(torch.device("cpu"), mean_logp_rewards([loss]))
    step.add(torch.tensor(0.0), beta, x.policy_chosen, x.policy_rejected, None, None, 10, x.chosen_tokens,
             x.rejected_tokens)
    logged = step.finish()
    held_out = preference_metrics(x, LossParams(beta=beta), [(loss, 1.0)])
    for name, want in trl.items():
        assert logged[name] == pytest.approx(float(want), rel=1e-5, abs=1e-6), name
        assert held_out[name] == pytest.approx(float(want), rel=1e-5, abs=1e-6), name
    if mean:  # these lengths make sums and means rank the pairs differently: the accuracy is TRL's, not the sums'
        sums = (beta * x.policy_chosen > beta * x.policy_rejected).float().mean()
        assert float(sums) != pytest.approx(logged["rewards/accuracies"])


def test_trl_sigmoid_ignores_label_smoothing_and_a_trl_command_is_told(caplog):
    from test_losses import our_loss, random_layout, trl_dpo_loss

    t, o = random_layout(seed=7)
    assert trl_dpo_loss(t, ["sigmoid"], label_smoothing=0.1) == pytest.approx(trl_dpo_loss(t, ["sigmoid"]), rel=1e-7)
    assert our_loss(o, ["sigmoid"], label_smoothing=0.1) != pytest.approx(our_loss(o, ["sigmoid"]), rel=1e-3)
    caplog.set_level(logging.INFO, logger="fastdpo")
    parse = lambda *f: build_config(build_parser().parse_args(["train", *f]), TrainConfig)  # noqa: E731
    cfg = parse("--model_name_or_path", "m", "--dataset_name", "d", "--label_smoothing", "0.1")
    assert cfg.label_smoothing == 0.1  # the flag given wins: cDPO, said once
    assert caplog.text.count("TRL 1.16's sigmoid loss ignores label_smoothing") == 1
    caplog.clear()
    parse("--model", "m", "--dataset", "d", "--label_smoothing", "0.1")  # not a TRL command: nothing to say
    parse("--model_name_or_path", "m", "--dataset_name", "d", "--loss_type", "robust", "--label_smoothing", "0.1")
    assert "ignores label_smoothing" not in caplog.text


def trl_tokenized(rows, tok):
    """TRL's DPOTrainer._prepare_dataset on these rows: prompt, chosen and rejected ids as TRL trains them."""
    from datasets import Dataset
    from trl.trainer.dpo_trainer import DPOTrainer

    args = SimpleNamespace(dataset_num_proc=None, max_length=None, truncation_mode="keep_start")
    ds = DPOTrainer._prepare_dataset(SimpleNamespace(_tokenizer=tok), Dataset.from_list(rows), tok, args, "train")
    return [(r["prompt_ids"], r["chosen_ids"], r["rejected_ids"]) for r in ds]


def test_a_prefilled_assistant_turn_scores_only_the_reply_as_trl():
    from fastdpo.data.formats import to_row
    from fastdpo.data.tokenize import TokenizeOptions, tokenize_rows

    tok = chat_tokenizer("chatml")
    rows = [{"prompt": [user("w1 w2"), assistant("w3")], "chosen": [assistant("w5 w6")], "rejected": [assistant("w7")]},
            {"prompt": [user("w1")], "chosen": [assistant("w5")], "rejected": [assistant("w8 w9")]}]
    pairs, _ = tokenize_rows(tok, [to_row(r, f"d:{i}") for i, r in enumerate(rows)], options=TokenizeOptions())
    assert [(p.prompt, p.chosen, p.rejected) for p in pairs] == trl_tokenized(rows, tok)
    assert tok.decode(pairs[0].chosen) == "w5 w6 <|im_end|>"  # no end of the prefilled turn, no header


def test_truncation_mode_keeps_what_trl_keeps():
    from trl.trainer.dpo_trainer import DataCollatorForPreference

    from fastdpo.data.tokenize import TokenizeOptions, TokenizeStats, fit_length

    parse = lambda *f: build_config(build_parser().parse_args(["train", "--model", "m", "--dataset", "d", *f]),  # noqa: E731
                                    TrainConfig)
    assert parse("--truncation_mode", "keep_start").truncation_strategy == "right"
    assert parse("--truncation_mode", "keep_end").truncation_strategy == "left"
    p, c, r = list(range(10, 16)), list(range(20, 25)), list(range(30, 33))  # prompt 6, chosen 5, rejected 3
    for mode, strategy in (("keep_start", "right"), ("keep_end", "left")):
        out = DataCollatorForPreference(pad_token_id=0, max_length=8, truncation_mode=mode)(
            [{"prompt_ids": p, "chosen_ids": c, "rejected_ids": r}])
        kept_c = out["input_ids"][0][out["attention_mask"][0].bool()].tolist()
        ours = fit_length(p, c, r, TokenizeOptions(max_length=8, truncation_strategy=strategy), TokenizeStats())
        assert ours[0] + ours[1] == kept_c  # the longer completion's sequence: the same tokens
        trl_completion_r = out["input_ids"][1][out["completion_mask"][1].bool()].tolist()
        assert ours[2] == trl_completion_r  # and the same rejected completion
    with pytest.raises(Exception, match="keep_start"):
        parse("--truncation_mode", "keep_middle")


def test_orpo_nll_is_the_chosen_completions_where_trl_counts_the_prompt_too(model_dirs):
    """The documented difference, measured on a real forward: TRL's ORPOTrainer's NLL is the token mean over the
    chosen sequence's prompt (after its first token) and completion; fastdpo's is over the completion only. The
    log-probs of the completions (and so the odds-ratio term) agree."""
    from transformers import AutoModelForCausalLM
    from trl.experimental.orpo import ORPOTrainer

    model = AutoModelForCausalLM.from_pretrained(model_dirs("qwen3"), dtype=torch.float32).eval()
    prompt, chosen, rejected = [5, 9, 12, 7], [20, 21, 22], [30, 31]
    batch = {}
    for name, comp in (("chosen", chosen), ("rejected", rejected)):
        ids = torch.tensor([prompt + comp])
        batch[f"{name}_input_ids"], batch[f"{name}_attention_mask"] = ids, torch.ones_like(ids)
        batch[f"{name}_labels"] = torch.tensor([[-100] * len(prompt) + comp])
    fake = SimpleNamespace(is_encoder_decoder=False, padding_value=0, aux_loss_enabled=False, accelerator=CPU,
                           concatenated_inputs=ORPOTrainer.concatenated_inputs,
                           get_batch_logps=ORPOTrainer.get_batch_logps)
    with torch.no_grad():
        trl_c, trl_r, _, _, trl_nll = ORPOTrainer.concatenated_forward(fake, model, batch)
        logp = torch.log_softmax(model(input_ids=torch.tensor([prompt + chosen])).logits[0].double(), -1)
        rlogp = torch.log_softmax(model(input_ids=torch.tensor([prompt + rejected])).logits[0].double(), -1)
    seq, rseq = prompt + chosen, prompt + rejected
    token = [float(logp[t - 1, seq[t]]) for t in range(1, len(seq))]  # every token after the first
    rtoken = [float(rlogp[t - 1, rseq[t]]) for t in range(len(prompt), len(rseq))]
    comp_c, comp_r = sum(token[len(prompt) - 1:]), sum(rtoken)
    assert float(trl_c[0]) == pytest.approx(comp_c / len(chosen), rel=1e-5)
    assert float(trl_r[0]) == pytest.approx(comp_r / len(rejected), rel=1e-5)
    assert float(trl_nll) == pytest.approx(-sum(token) / len(token), rel=1e-5)  # prompt + completion
    lengths = torch.tensor([len(chosen), len(rejected)])
    per_token = torch.tensor(token[len(prompt) - 1:] + rtoken)  # our completion log-probs: chosen, then rejected
    x = loss_inputs(summarise(per_token, torch.tensor([0] * len(chosen) + [1] * len(rejected)), lengths), None, lengths)
    lam = 0.25
    ours = float(LOSSES["orpo"].fn(x, LossParams(orpo_alpha=lam))[0])
    ratio = ORPOTrainer.odds_ratio_loss(SimpleNamespace(beta=lam, accelerator=CPU), trl_c.double(), trl_r.double())[0]
    assert ours == pytest.approx(-comp_c / len(chosen) - float(ratio[0]), rel=1e-5)  # completion-only NLL
    assert ours != pytest.approx(float(trl_nll) - float(ratio[0]), rel=1e-3)  # TRL's total differs by the prompt
