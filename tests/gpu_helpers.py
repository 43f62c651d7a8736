"""Helpers shared by the GPU parity tests: a small Qwen3 on CUDA, a relative error, and sequence log-probs with the
gradients they give."""

import torch
from transformers import AutoModelForCausalLM, Qwen3Config

from fastdpo.model.backend import sequence_logps


def qwen3(dtype, layers=4, **kw):
    """A randomly initialised Qwen3 of width 1024 with Qwen3's vocabulary, on CUDA (seeded: the same weights each
    call). `kw`: config overrides (a sliding window, ...)."""
    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=layers,
                      num_attention_heads=16, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True,
                      max_position_embeddings=8192, **kw)
    with torch.device("cuda"):
        return AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation="sdpa")


def rel(a, b):
    """|a - b| / |b| in float32 (Frobenius norms)."""
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def logps_and_grads(model, batches, backend):
    """The sequence log-probs of each batch (chosen then rejected) and the gradients of sum(chosen - rejected) over
    all of them, by parameter name; both copied in the model's dtype."""
    model.zero_grad()
    outs = []
    for batch in batches:
        seq, _ = sequence_logps(model, batch.to("cuda"), backend)
        b = batch.num_pairs
        (seq[:b] - seq[b:]).sum().backward()
        outs.append(seq.detach())
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return torch.cat(outs), grads
