"""Per-sequence summaries of completion log-probs, the inputs of every loss.

For each sequence (chosen of pairs 0..B-1, then rejected of pairs 0..B-1, as `PairBatch.seq` numbers them):
  sums    log-prob of the completion: the sum over its tokens;
  shared  the sum over its first min(C, R) tokens, the length both completions of its pair share (LD-DPO; a batch
          whose groups compute a completion once for several pairs has it for the first of them only, so LD-DPO
          packs without that: `Backend.dedupe`);
  wpo     mean over its tokens of log p(token) - log sum_v p_v^2 (WPO's aligned, length-normalised log-weight);
          without grad, and only when asked for.
And per pair (B,), only when the batch carries prompt targets (`PairBatch.prompt_src`, for ORPO's NLL):
  prompt  log-prob of the prompt's tokens after its first (the prompt shared by both sequences, counted once).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fastdpo.data.pack import PairBatch
from fastdpo.kernels.logprob_head import token_logps
from fastdpo.model.backend import Backend, output_head, target_hidden
from fastdpo.model.logprobs import sequence_sums, token_log_sum_sq_probs


@dataclass
class SeqLogps:
    """(2B,) float32 each, `prompt` (B,); see the module docstring."""

    sums: torch.Tensor
    shared: torch.Tensor
    wpo: torch.Tensor | None = None
    prompt: torch.Tensor | None = None

    def resolved(self, batch: PairBatch) -> SeqLogps:
        """Every sequence's and pair's own values where a grouped batch computed a completion (or a prompt) once
        for several (`PairBatch.seq_alias`, `prompt_alias`)."""
        out = self
        if batch.seq_alias is not None:
            a = batch.seq_alias
            out = SeqLogps(out.sums[a], out.shared[a], None if out.wpo is None else out.wpo[a], out.prompt)
        if batch.prompt_alias is not None and out.prompt is not None:
            out = SeqLogps(out.sums, out.shared, out.wpo, out.prompt[batch.prompt_alias])
        return out


def token_offsets(seq: torch.Tensor, num_seqs: int) -> torch.Tensor:
    """(N,) position of each token within its sequence, given that a sequence's tokens appear in order. No host
    sync (torch.bincount on CUDA would read the largest id back to size its output)."""
    order = torch.sort(seq, stable=True).indices
    counts = torch.zeros(num_seqs, dtype=seq.dtype, device=seq.device).index_add_(0, seq, torch.ones_like(seq))
    starts = counts.cumsum(0) - counts
    offsets = torch.empty_like(seq)
    offsets[order] = torch.arange(seq.numel(), device=seq.device) - starts[seq[order]]
    return offsets


def summarise(tok: torch.Tensor, seq: torch.Tensor, lengths: torch.Tensor,
              log_sum_sq: torch.Tensor | None = None, offsets: torch.Tensor | None = None) -> SeqLogps:
    """Per-token log-probs (N,) -> per-sequence `SeqLogps`. `lengths` (2B,) counts each sequence's tokens;
    `offsets` (N,), each token's position within its sequence, when the tokens are only some of the sequences'
    (a shard: the sums are then partial, completed across the shards by their sum)."""
    n = lengths.numel()
    b = n // 2
    shared_len = torch.minimum(lengths[:b], lengths[b:]).repeat(2)
    in_shared = (token_offsets(seq, n) if offsets is None else offsets) < shared_len[seq]
    sums = sequence_sums(tok, seq, n)
    shared = sequence_sums(torch.where(in_shared, tok, torch.zeros_like(tok)), seq, n)
    wpo = None
    if log_sum_sq is not None:
        wpo = sequence_sums(tok.detach() - log_sum_sq, seq, n) / lengths.clamp(min=1)
    return SeqLogps(sums, shared, wpo)


def completion_logps(model, batch: PairBatch, backend: Backend, mask=None, wpo: bool = False,
                     prompt: bool = True) -> SeqLogps:
    """One forward of `model` over the batch; `wpo` adds the WPO log-weights (one more no-grad pass over lm_head).
    The batch's prompt targets, when it carries them and `prompt` is on, go through lm_head in the same pass as the
    completion targets (`SeqLogps.prompt`); a batch without them costs nothing more. A mask with a `complete` method
    (sequence parallelism: the batch is this rank's shard of a row) turns the shard's partial sums into the whole
    row's."""
    with_prompt = prompt and batch.prompt_src is not None
    src = torch.cat([batch.src, batch.prompt_src]) if with_prompt else batch.src
    tgt = torch.cat([batch.tgt, batch.prompt_tgt]) if with_prompt else batch.tgt
    hidden = target_hidden(model, batch, backend, mask, src)
    head = output_head(model)
    tok = token_logps(hidden, head.weight, tgt, scale=head.scale, softcap=head.softcap, kernels=head.kernels)
    n = batch.tgt.numel()
    sq = None
    if wpo:
        sq = token_log_sum_sq_probs(hidden[:n].detach(), head.weight.detach(), scale=head.scale, softcap=head.softcap)
    out = summarise(tok[:n], batch.seq, batch.lengths, sq, batch.offsets)
    if with_prompt:
        out.prompt = sequence_sums(tok[n:], batch.prompt_pair, batch.num_pairs)
    complete = getattr(mask, "complete", None)
    return (complete(out) if complete is not None else out).resolved(batch)
