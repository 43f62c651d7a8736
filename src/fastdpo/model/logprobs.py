"""Per-sequence sums of token values, and the next-token distributions' log sum p² (WPO's weight alignment): the
log-prob helpers beside the head's op (`fastdpo.kernels.logprob_head.token_logps`, which gives each target token's
log-prob a chunk of logits at a time)."""

from __future__ import annotations

import torch

from fastdpo.kernels.logprob_head import DEFAULT_CHUNK, chunk_logits


def sequence_sums(values: torch.Tensor, seq: torch.Tensor, num_seqs: int) -> torch.Tensor:
    """Sum per-token values into per-sequence totals: values (N,), seq (N,) -> (num_seqs,)."""
    return torch.zeros(num_seqs, dtype=values.dtype, device=values.device).index_add_(0, seq, values)


@torch.no_grad()
def token_log_sum_sq_probs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    chunk: int = DEFAULT_CHUNK,
    scale: float = 1.0,
    softcap: float | None = None,
) -> torch.Tensor:
    """log sum_v p_v^2 of each of N next-token distributions, (N,) fp32, without grad (WPO's weight alignment).
    Computed as logsumexp(2 * logits) - 2 * logsumexp(logits), one chunk of logits at a time."""
    out = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
    for s in range(0, hidden.shape[0], chunk):
        logits, _ = chunk_logits(hidden[s : s + chunk], weight, scale, softcap)
        out[s : s + chunk] = torch.logsumexp(2 * logits, dim=-1) - 2 * torch.logsumexp(logits, dim=-1)
    return out
