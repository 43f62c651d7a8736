"""The tiny models' vocabulary, small models built in memory, and what autograd keeps of a forward."""

import torch
import torch.nn.functional as F

WORDS = [f"w{i}" for i in range(60)]  # the vocabulary of the tiny models `model_dirs` builds (`fastdpo.model.tiny`)


def saved_bytes(model, forward) -> int:
    """Bytes autograd keeps for the backward while `forward()` runs: each storage once, `model`'s weights (and views
    of them) not counted."""
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in weights:
            seen[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = forward()
    del out
    return sum(seen.values())


def small_model(family, dtype=torch.float32):
    """A seeded two-layer Qwen3 or Llama of width 64 (vocabulary 128) in training mode, its norms' weights moved away
    from ones so that their gradients mean something."""
    # imported here, not with the module: dist_helpers' forkserver preloads this module (through data_helpers), and
    # two-rank runs forked from a server that had imported transformers' model classes hung at times
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config

    torch.manual_seed(0)
    cls = Qwen3Config if family == "qwen3" else LlamaConfig
    extra = {"head_dim": 16} if family == "qwen3" else {}
    cfg = cls(vocab_size=128, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, **extra)
    m = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa", dtype=dtype)
    with torch.no_grad():  # norms away from ones, so their weight gradient means something
        for n, p in m.named_parameters():
            if "norm" in n:
                p.add_(torch.randn_like(p) * 0.1)
    return m.train()


def loss_and_grads(m, ids):
    """The logits (float32) and the gradients by parameter name of the mean log-prob of token 3."""
    m.zero_grad()
    out = m(input_ids=ids, use_cache=False).logits.float()
    loss = (out.log_softmax(-1)[..., 3]).mean()
    loss.backward()
    return out.detach(), {n: p.grad.float().clone() for n, p in m.named_parameters() if p.grad is not None}


def varlen_stand_in(q, k, v, cu_q, cu_k, max_q, max_k, scale, window):
    """The varlen kernel's contract in float32 (a stand-in for `fastdpo.model.attention._varlen_kernel` on the CPU):
    each sequence causal, aligned to its end, GQA by shared key heads."""
    out = torch.zeros_like(q)
    cu_q, cu_k = cu_q.tolist(), cu_k.tolist()
    for bound, cu in ((max_q, cu_q), (max_k, cu_k)):  # a power-of-two bound on the longest sequence
        assert bound >= max(b - a for a, b in zip(cu, cu[1:])) and bound & (bound - 1) == 0
    for s in range(len(cu_q) - 1):
        qs, ks, vs = q[cu_q[s]:cu_q[s + 1]], k[cu_k[s]:cu_k[s + 1]], v[cu_k[s]:cu_k[s + 1]]
        i = torch.arange(len(qs))[:, None] + len(ks) - len(qs)
        j = torch.arange(len(ks))[None]
        allow = (j <= i) if window is None else (j <= i) & (i - j < window)
        o = F.scaled_dot_product_attention(qs.transpose(0, 1), ks.transpose(0, 1), vs.transpose(0, 1),
                                           attn_mask=allow, scale=scale, enable_gqa=True)
        out[cu_q[s]:cu_q[s + 1]] = o.transpose(0, 1)
    return out


def admitted(pair_lengths, total: int, window: int | None) -> torch.Tensor:
    """(T, T) bool: query token q may see key token k under the offsets, as the kernel reads them."""
    from fastdpo.model.attention import varlen_layout  # on use: the processes that start ranks load this module

    key_index, cu_q, cu_k, _, _ = varlen_layout(pair_lengths, total)
    m = torch.zeros(total, total, dtype=torch.bool)
    for s in range(len(cu_q) - 1):
        n_q, n_k = cu_q[s + 1] - cu_q[s], cu_k[s + 1] - cu_k[s]
        for i in range(n_q):
            for j in range(n_k):
                shift = i + n_k - n_q  # causal aligned to the end of the sequence
                if j <= shift and (window is None or shift - j < window):
                    m[cu_q[s] + i, key_index[cu_k[s] + j]] = True
    return m
