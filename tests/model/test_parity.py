"""The packed, prefix-shared layout against the plain reference: separate unpacked forwards, full logits, float32."""

import functools

import pytest
import torch
from data_helpers import random_pairs
from transformers import AutoModelForCausalLM

from fastdpo.data.pack import pack_pairs, pad_pairs, split_micro_batches
from fastdpo.data.tokenize import TokenizedPair
from fastdpo.kernels.logprob_head import token_logps
from fastdpo.model import seqlogps
from fastdpo.model.backend import Backend, choose_backend, prepare_packed, sequence_logps

FAMILIES = [("llama", {}), ("qwen2", {}), ("qwen3", {}), ("mistral", {}), ("mistral", {"sliding_window": 6}),
            ("gemma", {})]


def load(path):
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    return model.eval()


def reference_logps(model, pairs):
    """Each sequence on its own: prompt+completion through the model, full logits, float32 log-softmax."""
    chosen, rejected = [], []
    for p in pairs:
        for comp, out in ((p.chosen, chosen), (p.rejected, rejected)):
            ids = torch.tensor([p.prompt + comp])
            logits = model(input_ids=ids).logits[0].double()
            logp = torch.log_softmax(logits, -1)
            start = len(p.prompt)
            out.append(sum(logp[t - 1, ids[0, t]] for t in range(start, ids.shape[1])))
    return torch.stack(chosen + rejected)


def packed_logps(model, pairs, backend, budget):
    """All pairs through packed micro-batches under a token budget; result in the original pair order."""
    out = {}
    for group in split_micro_batches(pairs, budget, 0):
        batch = pack_pairs(group)
        seq, _ = sequence_logps(model, batch, backend)
        b = len(group)
        for i, p in enumerate(group):
            out[p.index] = (seq[i], seq[b + i])
    return torch.stack([out[p.index][0] for p in pairs] + [out[p.index][1] for p in pairs])


@pytest.mark.parametrize("family,overrides", FAMILIES, ids=lambda x: str(x))
def test_packed_equals_separate_forwards(model_dirs, family, overrides):
    model = load(model_dirs(family, **overrides))
    backend = choose_backend(model, "dense", True, torch.device("cpu"))
    assert backend.name == "dense"
    assert backend.window == overrides.get("sliding_window")
    prepare_packed(model, backend)
    vocab = model.config.vocab_size
    # long enough that a sliding window of 6 matters; one pair longer than the budget of 40 tokens
    pairs = random_pairs(7, vocab, seed=1, max_prompt=14, max_comp=12)
    pairs[3].chosen = pairs[3].chosen * 4
    assert max(p.num_tokens for p in pairs) > 40
    with torch.no_grad():
        ref = reference_logps(model, pairs)
        fast = packed_logps(model, pairs, backend, budget=40)
        padded = sequence_logps(model, pad_pairs(pairs), Backend("padded"))[0]
    torch.testing.assert_close(fast.double(), ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(padded.double(), ref, rtol=1e-5, atol=1e-5)


def test_rejected_never_sees_chosen(model_dirs):
    """Changing chosen tokens must not move the rejected log-prob (and vice versa)."""
    model = load(model_dirs("qwen3"))
    backend = Backend("dense")
    prepare_packed(model, backend)
    pairs = random_pairs(3, model.config.vocab_size, seed=2)
    base = sequence_logps(model, pack_pairs(pairs), backend)[0].detach()
    pairs[1].chosen = [5] * len(pairs[1].chosen)
    moved = sequence_logps(model, pack_pairs(pairs), backend)[0].detach()
    assert not torch.allclose(base[1], moved[1])  # chosen of pair 1 changed
    torch.testing.assert_close(base[3 + 1], moved[3 + 1])  # its rejected did not
    torch.testing.assert_close(base[0], moved[0])  # other pairs did not
    torch.testing.assert_close(base[2], moved[2])


def test_gradients_match_padded_path(model_dirs):
    model = load(model_dirs("llama"))
    model.train()
    pairs = random_pairs(5, model.config.vocab_size, seed=3)
    weights = torch.linspace(0.5, 1.5, 10)

    def grads(batch, backend):
        model.zero_grad()
        seq, _ = sequence_logps(model, batch, backend)
        (seq * weights).sum().backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}

    prepare_packed(model, Backend("dense"))
    fast = grads(pack_pairs(pairs), Backend("dense"))
    slow = grads(pad_pairs(pairs), Backend("padded"))
    for name in slow:
        torch.testing.assert_close(fast[name], slow[name], rtol=1e-4, atol=1e-6, msg=name)


def reference_prompt_logps(model, pairs):
    """Each pair's prompt+chosen through the model on its own, full logits, float32: the log-prob of the prompt's
    tokens after its first (TRL's ORPO NLL counts them)."""
    out = []
    for p in pairs:
        ids = torch.tensor([p.prompt + p.chosen])
        logp = torch.log_softmax(model(input_ids=ids).logits[0].double(), -1)
        out.append(sum((logp[t - 1, ids[0, t]] for t in range(1, len(p.prompt))), torch.zeros((), dtype=torch.float64)))
    return torch.stack(out)


def test_prompt_targets_are_the_same_in_both_layouts():
    pairs = random_pairs(6, 50, seed=4, max_prompt=9)  # the first has a one-token prompt: no prompt target
    pairs.append(TokenizedPair([], [7, 8, 9], [10, 11], 6))  # no prompt at all: none either
    packed, padded = pack_pairs(pairs, 8, prompt_targets=True), pad_pairs(pairs, prompt_targets=True)
    want = [max(len(p.prompt) - 1, 0) for p in pairs]
    assert want[0] == 0 and want[-1] == 0 and max(want) > 1
    for batch in (packed, padded):
        assert batch.prompt_lengths.tolist() == want
        assert batch.prompt_tgt.tolist() == [t for p in pairs for t in p.prompt[1:]]
        assert batch.prompt_pair.tolist() == [i for i, n in enumerate(want) for _ in range(n)]
        # each target is the token right after the state that predicts it, in that state's row
        flat = batch.input_ids.reshape(-1)
        assert torch.equal(flat[batch.prompt_src + 1], batch.prompt_tgt)
    assert (padded.prompt_src // padded.input_ids.shape[1] < len(pairs)).all()  # from the chosen rows
    # without the option the batches carry none, and their completion targets are the same either way
    for with_prompt, plain in ((packed, pack_pairs(pairs, 8)), (padded, pad_pairs(pairs))):
        assert plain.prompt_src is None and plain.prompt_tgt is None and plain.prompt_lengths is None
        for name in ("input_ids", "position_ids", "src", "tgt", "seq", "lengths"):
            assert torch.equal(getattr(plain, name), getattr(with_prompt, name)), name


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_prompt_logps_packed_and_padded_equal_full_logits(model_dirs, monkeypatch, family):
    """The prompt targets' log-probs through the chunked lm_head (chunks of 5 rows, so chunks straddle completion
    and prompt targets), packed and padded, against separate forwards with full float32 logits; the completion
    log-probs stay those of a batch without prompt targets."""
    model = load(model_dirs(family))
    backend = Backend("dense")
    prepare_packed(model, backend)
    monkeypatch.setattr(seqlogps, "token_logps", functools.partial(token_logps, chunk=5))
    pairs = random_pairs(6, model.config.vocab_size, seed=5, max_prompt=12, max_comp=8)
    with torch.no_grad():
        want_prompt, want_seq = reference_prompt_logps(model, pairs), reference_logps(model, pairs)
        fast = seqlogps.completion_logps(model, pack_pairs(pairs, prompt_targets=True), backend)
        padded = seqlogps.completion_logps(model, pad_pairs(pairs, prompt_targets=True), Backend("padded"))
        plain = seqlogps.completion_logps(model, pack_pairs(pairs), backend)
        ref_side = seqlogps.completion_logps(model, pack_pairs(pairs, prompt_targets=True), backend, prompt=False)
    assert plain.prompt is None and ref_side.prompt is None
    for got in (fast, padded):
        torch.testing.assert_close(got.prompt.double(), want_prompt, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got.sums.double(), want_seq, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fast.sums, plain.sums, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(fast.shared, plain.shared, rtol=1e-6, atol=1e-6)


def test_prompt_gradients_match_padded_path(model_dirs):
    model = load(model_dirs("llama"))
    model.train()
    pairs = random_pairs(5, model.config.vocab_size, seed=6)
    weights = torch.linspace(0.5, 1.5, 5)

    def grads(batch, backend):
        model.zero_grad()
        out = seqlogps.completion_logps(model, batch, backend)
        (out.prompt * weights + out.sums[:5]).sum().backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}

    prepare_packed(model, Backend("dense"))
    fast = grads(pack_pairs(pairs, prompt_targets=True), Backend("dense"))
    slow = grads(pad_pairs(pairs, prompt_targets=True), Backend("padded"))
    for name in slow:
        torch.testing.assert_close(fast[name], slow[name], rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("loss,prompt", [("sigmoid", False), ("simpo", False), ("orpo", True), ("sigmoid,orpo", True)])
def test_lm_head_sees_prompt_targets_only_for_orpo(tmp_path, model_dirs, monkeypatch, loss, prompt):
    """Training and evaluation steps put prompt tokens through the output head only when the loss needs them
    (ORPO's NLL), and only for the policy: a loss without it costs what it did, and the reference never needs them."""
    from fastdpo.config import TrainConfig
    from fastdpo.model.load import load_model, load_tokenizer
    from fastdpo.training import evaluate
    from fastdpo.training.setup import assemble
    from fastdpo.training.trainer import Trainer

    rows = []
    monkeypatch.setattr(seqlogps, "token_logps", lambda h, *a, **k: rows.append(h.shape[0]) or token_logps(h, *a, **k))
    m = model_dirs("qwen3")
    pairs = random_pairs(4, 60, seed=7)
    cfg = TrainConfig(model=str(m), dataset=["unused"], output_dir=str(tmp_path), loss_type=loss,
                      per_device_train_batch_size=4, loss_weights="1,1" if "," in loss else "")
    model = load_model(str(m), torch.float32, torch.device("cpu"))
    trainer = Trainer(cfg, assemble(cfg, torch.device("cpu"), model, load_tokenizer(str(m)), pairs))
    completion = sum(len(p.chosen) + len(p.rejected) for p in pairs)
    prompt_rows = sum(len(p.prompt) - 1 for p in pairs)
    assert prompt_rows > 0
    trainer.step(pairs)
    held_out = evaluate.TrainingEval(cfg, pairs).run(trainer.s, 1, 1.0)
    assert ("eval_nll_loss" in held_out) == prompt
    policy = completion + prompt_rows * prompt
    reference = [completion] if trainer.s.reference.online else []
    assert rows == [policy, *reference] * 2  # the training step, then the evaluation


def test_mixed_layer_types_fall_back_to_padded(model_dirs):
    model = load(model_dirs("qwen2", use_sliding_window=True, sliding_window=4, max_window_layers=1))
    assert choose_backend(model, "auto", True, torch.device("cpu")).name == "padded"


@pytest.mark.parametrize("name", ["flash_attn", "flash_attention_2", "sdpa", "eager"])
def test_foreign_attn_names_are_accepted(model_dirs, name, caplog):
    import logging

    model = load(model_dirs("qwen3"))
    with caplog.at_level(logging.INFO, logger="fastdpo"):
        backend = choose_backend(model, name, True, torch.device("cpu"))
    assert backend.name == "dense"
    assert f"--attn_impl {name}" in caplog.text
