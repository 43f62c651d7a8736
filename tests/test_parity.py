"""The packed, prefix-shared layout against the plain reference: separate unpacked forwards, full logits, float32."""

import pytest
import torch
from conftest import random_pairs
from transformers import AutoModelForCausalLM

from fastdpo.data.pack import pack_pairs, pad_pairs, split_micro_batches
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
