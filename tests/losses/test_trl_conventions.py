"""Conventions a user coming from TRL meets, each compared with TRL 1.16's own code (skipped without TRL; the test
extra installs it): SimPO/ORPO log per-token mean log-probs and beta x mean rewards (CPO sums, as TRL); TRL's
sigmoid ignores --label_smoothing, which a TRL command is told; a prefilled assistant turn is rendered as TRL renders
it, scoring only the reply; --truncation_mode keep_start/keep_end with TRL's meaning; ORPO equals TRL's ORPOTrainer
step for step (its NLL over the chosen sequences' prompt and completion, its metrics and its gradients)."""

import importlib.util
import logging
from types import SimpleNamespace

import pytest
import torch
from data_helpers import assistant, chat_tokenizer, user

from fastdpo.cli import build_parser
from fastdpo.config import TrainConfig, build_config
from fastdpo.losses import LossParams, loss_inputs, mean_logp_rewards, sequence_nll
from fastdpo.model.seqlogps import SeqLogps, summarise
from fastdpo.observe.metrics import StepMetrics
from fastdpo.training.evaluate import TrainingEval, preference_metrics

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
    """Our per-token log-probs of the same targets, summarised per sequence (the prompts' tokens carry no targets
    here: no prompt log-probs, for ORPO's NLL)."""
    lab, lg = labels[:, 1:], logits[:, :-1]
    mask = lab != -100
    tok = torch.log_softmax(lg, -1).gather(-1, lab.clamp(min=0)[..., None])[..., 0]
    rows, cols = mask.nonzero(as_tuple=True)
    lengths = mask.sum(1)
    seqs = summarise(tok[rows, cols].float(), rows, lengths)
    b = lengths.numel() // 2
    seqs.prompt = torch.zeros(b)
    return loss_inputs(seqs, None, lengths, prompt_lengths=torch.zeros(b, dtype=torch.long))


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
    from losses.test_losses import our_loss, random_layout, trl_dpo_loss

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


# prompts of 1 (<bos> alone), 2, 3 and 6 tokens; completions of 2 to 4 tokens (<eos> included)
ORPO_ROWS = [{"prompt": "", "chosen": "w5 w6", "rejected": "w7 w8 w9"},
             {"prompt": "w1", "chosen": " w5 w6", "rejected": " w7 w8 w9"},
             {"prompt": "w1 w2 w3 w4 w10", "chosen": " w5", "rejected": " w7 w8"},
             {"prompt": "w11 w12", "chosen": " w13 w14 w15", "rejected": " w16"}]


def trl_orpo_step(model_dir, rows, lam, out):
    """TRL's ORPOTrainer on `rows` as one batch: its tokenised rows, loss, logged metrics and gradients."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl.experimental.orpo import ORPOConfig, ORPOTrainer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    args = ORPOConfig(output_dir=str(out), report_to=[], beta=lam, use_cpu=True, remove_unused_columns=False)
    trainer = ORPOTrainer(model=model, args=args, train_dataset=Dataset.from_list(rows),
                          processing_class=AutoTokenizer.from_pretrained(model_dir))
    data = list(trainer.train_dataset)
    loss, logged = trainer.get_batch_loss_metrics(trainer.model, trainer.data_collator(data))
    loss.backward()
    tokens = [(r["prompt_input_ids"], r["chosen_input_ids"], r["rejected_input_ids"]) for r in data]
    return tokens, float(loss.detach()), logged, {n: q.grad.clone() for n, q in model.named_parameters()}


@pytest.mark.parametrize("layout,budget", [("packed", 0), ("padded", 0), ("packed", 24)])
def test_orpo_equals_trl_orpo_trainer(tmp_path, model_dirs, one_thread, layout, budget):
    """One fastdpo ORPO step against TRL's ORPOTrainer on the same weights and rows: the loss (NLL over the chosen
    sequences' prompt and completion, token mean; minus lambda x mean ls(log odds)), the metrics TRL logs
    (nll_loss, log_odds_ratio, log_odds_chosen, rewards/*, logps/*) and every gradient, in float32; in the packed
    and the padded layout, and with the step cut into micro-batches (the NLL stays the step's token mean)."""
    from fastdpo.data.formats import to_row
    from fastdpo.data.tokenize import TokenizeOptions, tokenize_rows
    from fastdpo.model.load import load_model, load_tokenizer
    from fastdpo.training.setup import assemble
    from fastdpo.training.trainer import Trainer

    m, lam = model_dirs("qwen3"), 0.25
    trl_tokens, trl_loss, trl_logged, trl_grads = trl_orpo_step(m, ORPO_ROWS, lam, tmp_path / "trl")
    tok = load_tokenizer(str(m))
    pairs, _ = tokenize_rows(tok, [to_row(r, f"d:{i}") for i, r in enumerate(ORPO_ROWS)], options=TokenizeOptions())
    # fastdpo tokenises these rows as TRL's ORPOTrainer does: <bos> opens the prompt, <eos> closes each completion
    assert [(p.prompt, p.prompt + p.chosen, p.prompt + p.rejected) for p in pairs] == trl_tokens
    assert sorted(len(p.prompt) for p in pairs) == [1, 2, 3, 6]

    cfg = TrainConfig(model=str(m), dataset=["unused"], output_dir=str(tmp_path / "ours"), loss_type="orpo",
                      orpo_alpha=lam, beta=lam, per_device_train_batch_size=len(pairs), max_grad_norm=0.0,
                      padding_free=layout == "packed", max_tokens_per_batch=budget)
    model = load_model(str(m), torch.float32, torch.device("cpu"))
    trainer = Trainer(cfg, assemble(cfg, torch.device("cpu"), model, tok, pairs))
    assert trainer.s.backend.name == ("dense" if layout == "packed" else "padded")
    held_out = TrainingEval(cfg, pairs).run(trainer.s, 0, 0.0)  # before the step: the same weights as TRL's
    grads = {}
    for name, q in trainer.s.model.named_parameters():  # the accumulated gradient, before the update clears it
        q.register_post_accumulate_grad_hook(lambda q, name=name: grads.__setitem__(name, q.grad.clone()))
    result = trainer.step(pairs)
    assert result.metrics.micro_batches == (1 if not budget else 2)
    logged = result.metrics.finish()
    for name in ("loss", "nll_loss", "log_odds_ratio", "log_odds_chosen", "rewards/chosen", "rewards/rejected",
                 "rewards/margins", "rewards/accuracies", "logps/chosen", "logps/rejected"):
        want = trl_loss if name == "loss" else trl_logged[name]
        assert logged[name] == pytest.approx(want, rel=1e-5, abs=1e-6), name
        assert held_out[f"eval_{name}"] == pytest.approx(want, rel=1e-5, abs=1e-6), name
    assert trl_grads.keys() == grads.keys()
    for name, g in trl_grads.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-5, atol=1e-6, msg=name)


def test_orpo_nll_counts_the_prompt_as_trl_does():
    """The NLL term against TRL's `ORPOTrainer.concatenated_forward` on given logits: a token mean over the batch's
    chosen rows, [prompt | chosen] after each row's first token (not a mean of per-sequence means), and the
    completions' mean log-probs of the odds ratio."""
    from trl.experimental.orpo import ORPOTrainer

    g = torch.Generator().manual_seed(3)
    vocab, plen, clen, rlen = 13, [1, 4, 2], [3, 1, 5], [2, 2, 2]
    b, width = len(plen), max(p + n for p, n in zip(plen * 2, clen + rlen))
    ids = torch.randint(0, vocab, (2 * b, width), generator=g)
    ids[b:, : max(plen)] = ids[:b, : max(plen)]  # one prompt per pair
    logits = torch.randn(2 * b, width, vocab, generator=g, dtype=torch.float64)
    batch = {}
    for name, rows, lens in (("chosen", slice(0, b), clen), ("rejected", slice(b, 2 * b), rlen)):
        mask = torch.zeros(b, width, dtype=torch.long)
        for i, (p, n) in enumerate(zip(plen, lens)):
            mask[i, : p + n] = 1
        labels = torch.where(mask == 1, ids[rows], -100)
        for i, p in enumerate(plen):
            labels[i, :p] = -100
        batch.update({f"{name}_input_ids": ids[rows], f"{name}_attention_mask": mask, f"{name}_labels": labels})
    fake = SimpleNamespace(is_encoder_decoder=False, padding_value=0, aux_loss_enabled=False, accelerator=CPU,
                           concatenated_inputs=ORPOTrainer.concatenated_inputs,
                           get_batch_logps=ORPOTrainer.get_batch_logps)
    model = lambda input_ids, **kw: SimpleNamespace(logits=logits)  # noqa: E731
    trl_c, trl_r, _, _, trl_nll = ORPOTrainer.concatenated_forward(fake, model, batch)

    tok = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0]
    prompt = torch.stack([tok[i, : p - 1].sum() for i, p in enumerate(plen)]).float()
    comp = torch.stack([tok[i, p - 1: p + n - 1].sum() for i, (p, n) in enumerate(zip(plen * 2, clen + rlen))]).float()
    x = loss_inputs(SeqLogps(comp, comp, prompt=prompt), None, torch.tensor(clen + rlen),
                    prompt_lengths=torch.tensor([p - 1 for p in plen]))
    assert float(sequence_nll(x).mean()) == pytest.approx(float(trl_nll), rel=1e-6)
    torch.testing.assert_close(x.policy_chosen / x.chosen_tokens, trl_c.float())
    torch.testing.assert_close(x.policy_rejected / x.rejected_tokens, trl_r.float())
    per_sequence = (-(prompt + comp[:b]) / (torch.tensor(plen) - 1 + torch.tensor(clen))).mean()
    assert float(per_sequence) != pytest.approx(float(trl_nll), rel=1e-3)  # TRL's is not a mean of sequence means
