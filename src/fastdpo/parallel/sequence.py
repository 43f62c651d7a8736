"""Sequence parallelism: the N ranks of a group share one packed micro-batch's tokens (DESIGN §1, §8).

The row is padded with filler to a multiple of 2N and cut zig-zag into 2N equal chunks; rank r holds chunks r and
2N-1-r, so every rank gets as much causal attention work as the others. Each rank runs the decoder on its own
tokens (their own position ids) and keeps the completion targets whose predicting hidden state it holds. Attention
stays exact for the pair rule (`model.attention.allowed`) wherever the cuts fall:

- ulysses: an all-to-all turns (this rank's tokens, all heads) into (all tokens in packed order, H/N heads); the
  full-row attention of the backend (dense, flex or varlen, its mask or offsets built once for the whole row) runs
  on those heads, and a second all-to-all brings (this rank's tokens, all heads) back. Needs H % N == 0. Key/value
  heads that N does not divide are replicated by the smallest factor f for which Hkv*f is a multiple of N, i.e.
  Hkv*f = lcm(Hkv, N), which also divides H (both Hkv and N do): query head h still reads a copy of its own
  key/value head h // (H / Hkv).
- ring: each rank keeps its queries; the key/value chunks travel around the group (N - 1 point-to-point shifts,
  whose backward shifts the gradient the other way, so autograd gives the ring's backward). Each (query chunk, key
  chunk) block is explicit float32 math with the rule's mask on global token indices and positions, returning its
  output and log-sum-exp; blocks are merged with the online-softmax rule. A block the rule masks entirely is skipped.
  A block runs a slice of query rows at a time and recomputes its scores in the backward (`BlockAttention`), so a
  rank keeps the replicated keys and values and the block outputs, never a block's scores.

The per-sequence sums (sums, shared, wpo) of a shard are partial; `SequenceMask.complete` sums them over the group
with an all-reduce whose backward is the identity. Every rank of a group then holds the whole row's sums and the
same loss, and its backward gives the gradient through its own tokens; the parameter gradients summed over all
ranks (DDP and FSDP2 here sum, `wrap`) are the single-process gradient.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from fastdpo.data.pack import PairBatch
from fastdpo.errors import FastDPOError
from fastdpo.model import attention
from fastdpo.model.backend import Backend, build_mask
from fastdpo.model.load import base_causal_lm
from fastdpo.model.seqlogps import SeqLogps, token_offsets
from fastdpo.parallel.distributed import Dist

ULYSSES_NAME = "fastdpo_ulysses"
RING_NAME = "fastdpo_ring"
NEG = -1e30  # a masked score: finite, so a block row the rule masks entirely has no NaN (its weight is exp(-1e30))


# ---------------------------------------------------------------- mode


def kv_replication(heads: int, kv_heads: int, n: int) -> int:
    """Ulysses: how many copies of each key/value head make their count a multiple of n (1: none needed)."""
    return n // math.gcd(kv_heads, n)


def resolve_mode(model, requested: str, n: int, backend: Backend) -> str:
    """ulysses or ring for a group of n ranks; FastDPOError for what cannot be split."""
    if backend.name == "padded":
        raise FastDPOError("--sequence_parallel_size splits the packed row, and this run uses the padded path (see "
                           "the line above that says why). Sequence parallelism cannot split padded rows.")
    if backend.vision is not None:
        raise FastDPOError("--sequence_parallel_size with a vision-language model: its packed row is not split over "
                           "ranks (the images' features and M-RoPE positions are placed per prompt). Train it with "
                           "--sequence_parallel_size 1; data parallelism (more processes) and FSDP2 still apply.")
    cfg = base_causal_lm(model).config
    heads = cfg.num_attention_heads
    if requested == "ring" or (requested == "auto" and heads % n):
        return "ring"
    if heads % n:
        raise FastDPOError(f"--sequence_parallel_mode ulysses splits the {heads} attention heads over "
                           f"--sequence_parallel_size {n} ranks, which does not divide them. Use "
                           "--sequence_parallel_mode ring (or auto), or a size that divides the heads.")
    return "ulysses"


def register() -> None:
    """Make the sequence-parallel attention functions valid attention implementations (idempotent). No mask
    function: transformers builds no mask, and the context arrives as a keyword argument."""
    from transformers import AttentionInterface

    attention.register()
    AttentionInterface.register(ULYSSES_NAME, ulysses_attention)
    AttentionInterface.register(RING_NAME, ring_attention)


# ---------------------------------------------------------------- the zig-zag shard


def zigzag_index(total: int, n: int, rank: int) -> torch.Tensor:
    """Global token indices held by `rank` of n, in local order: chunks rank and 2n-1-rank of 2n equal chunks."""
    assert total % (2 * n) == 0, (total, n)
    c = total // (2 * n)
    return torch.cat([torch.arange(rank * c, (rank + 1) * c), torch.arange((2 * n - 1 - rank) * c, (2 * n - rank) * c)])


def owner(index: torch.Tensor, total: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(rank, local position) of global token indices under the zig-zag cut."""
    c = total // (2 * n)
    k = index // c
    first = k < n
    return torch.where(first, k, 2 * n - 1 - k), torch.where(first, index - k * c, c + index - k * c)


def pad_row(batch: PairBatch, multiple: int, pad_id: int = 0) -> PairBatch:
    """The packed row with filler tokens appended up to a multiple of `multiple` (filler attends only to filler)."""
    extra = (-batch.num_tokens) % multiple
    if extra == 0:
        return batch
    dev = batch.input_ids.device

    def grow(t: torch.Tensor, value: int) -> torch.Tensor:
        return torch.cat([t, torch.full((*t.shape[:-1], extra), value, dtype=t.dtype, device=dev)], dim=-1)

    return PairBatch(**{**vars(batch), "input_ids": grow(batch.input_ids, pad_id),
                        "position_ids": grow(batch.position_ids, 0), "pair_ids": grow(batch.pair_ids, -1),
                        "segments": grow(batch.segments, 0)})


def shard_batch(batch: PairBatch, n: int, rank: int) -> PairBatch:
    """Rank `rank`'s shard of a packed row whose length is a multiple of 2n: its tokens, and the targets predicted
    by hidden states it holds (src as local indices, each with its offset within its sequence in the whole row)."""
    assert batch.attention_mask is None and batch.num_tokens % (2 * n) == 0
    total = batch.num_tokens
    idx = zigzag_index(total, n, rank).to(batch.input_ids.device)
    who, local = owner(batch.src, total, n)
    keep = who == rank
    offsets = batch.offsets if batch.offsets is not None else token_offsets(batch.seq, batch.lengths.numel())
    prompt = {}
    if batch.prompt_src is not None:  # ORPO's prompt targets: those predicted by this rank's hidden states
        p_who, p_local = owner(batch.prompt_src, total, n)
        p_keep = p_who == rank
        prompt = {"prompt_src": p_local[p_keep], "prompt_tgt": batch.prompt_tgt[p_keep],
                  "prompt_pair": batch.prompt_pair[p_keep], "prompt_lengths": batch.prompt_lengths}
    return PairBatch(
        input_ids=batch.input_ids[:, idx], position_ids=batch.position_ids[:, idx], src=local[keep],
        tgt=batch.tgt[keep], seq=batch.seq[keep], lengths=batch.lengths, index=batch.index,
        pair_ids=batch.pair_ids[idx], segments=batch.segments[idx], pair_lengths=batch.pair_lengths,
        offsets=offsets[keep], seq_alias=batch.seq_alias, prompt_alias=batch.prompt_alias, **prompt,
    )


# ---------------------------------------------------------------- the context the attention functions read


@dataclass
class SequenceContext:
    """One micro-batch's sequence-parallel layout, shared by all layers. `order` (T,): global index of each token
    in rank-major order (rank 0's tokens, then rank 1's, ...); `inverse`: its inverse permutation. Ulysses: `inner`
    is the full row's mask or offsets for the backend's attention. Ring: `meta` (n, 4, T/n) long, each rank's tokens'
    (pair id, segment, global index, position); `blocks[s]`: whether this rank's queries see any key of the chunk it
    holds at ring step s."""

    group: object
    ranks: list[int]
    rank: int
    mode: str
    order: torch.Tensor
    inverse: torch.Tensor
    inner: object = None
    meta: torch.Tensor | None = None
    blocks: tuple[bool, ...] = ()

    @property
    def size(self) -> int:
        return len(self.ranks)


@dataclass
class SequenceMask:
    """What `model.backend.target_hidden` passes to every layer (the attention function it names, and its keyword
    arguments), and how `completion_logps` completes a shard's sums."""

    ctx: SequenceContext

    @property
    def attn_name(self) -> str:
        return ULYSSES_NAME if self.ctx.mode == "ulysses" else RING_NAME

    def kwargs(self) -> dict:
        return {"fastdpo_sp": self.ctx}

    def complete(self, out: SeqLogps) -> SeqLogps:
        def total(x):
            return None if x is None else group_sum(x, self.ctx.group)

        return SeqLogps(total(out.sums), total(out.shared), total(out.wpo), total(out.prompt))


def group_sum(x: torch.Tensor, group) -> torch.Tensor:
    """The sum of `x` over the group, whose backward is the identity: each rank's gradient flows into its own part
    only (the loss, equal on every rank of the group, is counted once when the parameter gradients are summed)."""
    import torch.distributed as dist

    total = x.detach().clone()
    dist.all_reduce(total, group=group)
    return x + (total - x.detach())


def split_micro_batch(batch: PairBatch, backend: Backend, d: Dist, pad_id: int = 0) -> tuple[PairBatch, object]:
    """(the batch this rank runs, its mask): the whole micro-batch and `build_mask` without sequence parallelism;
    with it, this rank's zig-zag shard and the group's SequenceMask (the full row's mask built once, inside)."""
    if d.sp_size == 1:
        return batch, build_mask(batch, backend)
    return shard_micro_batch(batch, backend, d.sp_group, d.sp_ranks, d.sp_rank, d.sp_mode, pad_id)


def shard_micro_batch(batch: PairBatch, backend: Backend, group, ranks: list[int], r: int, mode: str,
                      pad_id: int = 0) -> tuple[PairBatch, SequenceMask]:
    """Rank `r`'s shard of the micro-batch and the SequenceMask of its group (`ranks`, global ranks in order)."""
    n = len(ranks)
    if batch.attention_mask is not None:
        raise FastDPOError("sequence parallelism splits packed rows; this micro-batch is in the padded layout.")
    multiple = 2 * n if backend.name != "flex" else math.lcm(2 * n, attention.FLEX_BLOCK)
    full = pad_row(batch, multiple, pad_id)
    total = full.num_tokens
    order = torch.cat([zigzag_index(total, n, j) for j in range(n)]).to(full.input_ids.device)
    ctx = SequenceContext(group, ranks, r, mode, order, torch.argsort(order))
    if mode == "ulysses":
        ctx.inner = build_mask(full, backend)
    else:
        pos = full.position_ids[0]
        meta = torch.stack([full.pair_ids.long(), full.segments.long(), torch.arange(total, device=pos.device), pos])
        ctx.meta = meta[:, order].view(4, n, total // n).transpose(0, 1).contiguous()
        ctx.blocks = ring_blocks(ctx.meta.cpu(), r, backend.window)
    return shard_batch(full, n, r), SequenceMask(ctx)


def ring_blocks(meta: torch.Tensor, rank: int, window: int | None) -> tuple[bool, ...]:
    """For each ring step s, whether `rank`'s queries see any key of rank (rank - s) mod n's chunk (on the host)."""
    n = meta.shape[0]
    q = meta[rank]
    return tuple(bool(_rule(q, meta[(rank - s) % n], window).any()) for s in range(n))


def _rule(q: torch.Tensor, k: torch.Tensor, window: int | None) -> torch.Tensor:
    """(tq, tk) bool: the pair rule between query tokens and key tokens, each described by (4, t) metadata."""
    return attention.allowed(q[0, :, None], k[0, None, :], q[1, :, None], k[1, None, :], q[2, :, None], k[2, None, :],
                             q[3, :, None], k[3, None, :], window)


# ---------------------------------------------------------------- communication with autograd


class _AllToAll(torch.autograd.Function):
    """all_to_all_single over dim 0 split in equal parts; with equal parts it is its own inverse, so the backward
    is the same exchange of the gradient."""

    @staticmethod
    def forward(ctx, x, group):
        import torch.distributed as dist

        ctx.group = group
        x = x.contiguous()
        out = torch.empty_like(x)  # of x made contiguous: the exchange writes memory in row-major order
        dist.all_to_all_single(out, x, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        import torch.distributed as dist

        grad = grad.contiguous()
        out = torch.empty_like(grad)
        dist.all_to_all_single(out, grad, group=ctx.group)
        return out, None


class _RingShift(torch.autograd.Function):
    """Send x to the next rank of the group and receive the previous rank's; the backward sends the gradient back."""

    @staticmethod
    def forward(ctx, x, group, to: int, frm: int):
        ctx.group, ctx.to, ctx.frm = group, to, frm
        return _exchange(x.contiguous(), group, to, frm)

    @staticmethod
    def backward(ctx, grad):
        return _exchange(grad.contiguous(), ctx.group, ctx.frm, ctx.to), None, None, None


def _exchange(x: torch.Tensor, group, to: int, frm: int) -> torch.Tensor:
    import torch.distributed as dist

    out = torch.empty_like(x)
    ops = [dist.P2POp(dist.isend, x, to, group), dist.P2POp(dist.irecv, out, frm, group)]
    for req in dist.batch_isend_irecv(ops):
        req.wait()
    return out


def heads_to_tokens(x: torch.Tensor, ctx: SequenceContext) -> torch.Tensor:
    """(1, h, t, D) this rank's tokens, all heads -> (1, h/n, n*t, D) every token in packed order, this rank's
    share of the heads (head group r of n), laid out as transformers lays out its query (a transposed (T, h/n, D))."""
    n, (_, h, t, dim) = ctx.size, x.shape
    y = _AllToAll.apply(x.squeeze(0).reshape(n, h // n, t, dim), ctx.group)  # y[j]: rank j's tokens, my heads
    y = y.transpose(1, 2).reshape(n * t, h // n, dim)  # rank-major tokens
    return y.index_select(0, ctx.inverse).transpose(0, 1)[None]


def tokens_to_heads(y: torch.Tensor, ctx: SequenceContext) -> torch.Tensor:
    """The inverse of `heads_to_tokens` for an attention output: (1, T, h/n, D) -> (1, T/n, h, D)."""
    n, (_, total, hn, dim) = ctx.size, y.shape
    y = y[0].index_select(0, ctx.order).view(n, total // n, hn, dim).transpose(1, 2)  # y[j]: rank j's tokens
    y = _AllToAll.apply(y.contiguous(), ctx.group)  # y[j]: my tokens, head group j
    return y.reshape(hn * n, total // n, dim).transpose(0, 1)[None]


# ---------------------------------------------------------------- attention functions


def ulysses_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers attention function: query (1, H, t, D), key/value (1, Hkv, t, D) of this rank's tokens ->
    ((1, t, H, D), None), through the backend's full-row attention on H/N heads."""
    ctx: SequenceContext = kwargs.pop("fastdpo_sp")
    n = ctx.size
    f = kv_replication(query.shape[1], key.shape[1], n)
    if f > 1:  # each key/value head copied next to itself: query head h keeps reading a copy of its own
        key, value = key.repeat_interleave(f, dim=1), value.repeat_interleave(f, dim=1)
    q, k, v = heads_to_tokens(query, ctx), heads_to_tokens(key, ctx), heads_to_tokens(value, ctx)
    if isinstance(ctx.inner, attention.VarlenMask):
        out, _ = attention.varlen_attention(module, q, k, v, None, scaling, dropout, **ctx.inner.kwargs(), **kwargs)
    else:
        out, _ = attention.fastdpo_attention(module, q, k, v, ctx.inner, scaling, dropout, **kwargs)
    return tokens_to_heads(out, ctx).contiguous(), None


def block_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_meta: torch.Tensor, k_meta: torch.Tensor,
                    window: int | None, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """One (query chunk, key chunk) block in float32: q (H, tq, D), k/v (Hkv, tk, D) -> output (H, tq, D) and
    log-sum-exp (H, tq). A query row the rule masks entirely gets log-sum-exp about -1e30 (weight 0 when merged).
    Plain autograd: the reference `BlockAttention` (which ring attention runs) is tested against."""
    heads, tq, dim = q.shape
    kv_heads = k.shape[0]
    qg = q.float().reshape(kv_heads, heads // kv_heads, tq, dim)  # query heads grouped by their key/value head
    s = torch.einsum("hgqd,hkd->hgqk", qg, k.float()) * scale
    s = s.masked_fill(~_rule(q_meta, k_meta, window), NEG)
    m = s.amax(dim=-1, keepdim=True)
    p = torch.exp(s - m)
    total = p.sum(dim=-1, keepdim=True)
    out = torch.einsum("hgqk,hkd->hgqd", p, v.float()) / total
    lse = (m + total.log()).squeeze(-1)
    return out.reshape(heads, tq, dim), lse.reshape(heads, tq)


BLOCK_SCORES = 1 << 24  # float32 scores of one slice of query rows (H x rows x keys) alive at once: 64 MiB


def _rows(heads: int, keys: int) -> int:
    return max(1, BLOCK_SCORES // max(heads * keys, 1))


class BlockAttention(torch.autograd.Function):
    """`block_attention` a slice of query rows at a time, forward and backward (FlashAttention's recomputation, in
    float32 matrix products): only one slice's scores exist at any moment, and only q, k, v, the output and its
    log-sum-exp are kept for the backward. Outputs (H, tq, D) and (H, tq), float32 (merged in float32)."""

    @staticmethod
    def forward(ctx, q, k, v, q_meta, k_meta, window, scale):
        heads, tq, dim = q.shape
        out = torch.empty(heads, tq, dim, dtype=torch.float32, device=q.device)
        lse = torch.empty(heads, tq, dtype=torch.float32, device=q.device)
        step = _rows(heads, k.shape[1])
        for a in range(0, tq, step):
            out[:, a : a + step], lse[:, a : a + step] = block_attention(
                q[:, a : a + step], k, v, q_meta[:, a : a + step], k_meta, window, scale)
        ctx.save_for_backward(q, k, v, q_meta, k_meta, out)
        ctx.window, ctx.scale = window, scale
        return out, lse

    @staticmethod
    def backward(ctx, g_out, g_lse):
        q, k, v, q_meta, k_meta, out = ctx.saved_tensors
        heads, tq, dim = q.shape
        kv_heads, g = k.shape[0], heads // k.shape[0]
        kf, vf = k.float(), v.float()
        dq = torch.empty(heads, tq, dim, dtype=torch.float32, device=q.device)
        dk = torch.zeros(kf.shape, dtype=torch.float32, device=k.device)
        dv = torch.zeros(vf.shape, dtype=torch.float32, device=v.device)
        step = _rows(heads, k.shape[1])
        for a in range(0, tq, step):
            rows = slice(a, a + step)
            qg = q[:, rows].float().reshape(kv_heads, g, -1, dim)
            allowed_here = _rule(q_meta[:, rows], k_meta, ctx.window)
            s = torch.einsum("hgqd,hkd->hgqk", qg, kf) * ctx.scale
            s = s.masked_fill(~allowed_here, NEG)
            p = torch.softmax(s, dim=-1)  # the forward's weights, recomputed (a masked row's uniform ones too)
            go = g_out[:, rows].float().reshape(kv_heads, g, -1, dim)
            dv += torch.einsum("hgqk,hgqd->hkd", p, go)
            dp = torch.einsum("hgqd,hkd->hgqk", go, vf)
            # d out / d s = p (dp - rowsum(go * out)); d lse / d s = p
            row = (go * out[:, rows].reshape(kv_heads, g, -1, dim)).sum(-1, keepdim=True)
            ds = p * (dp - row + g_lse[:, rows].reshape(kv_heads, g, -1, 1))
            ds = ds.masked_fill(~allowed_here, 0.0) * ctx.scale  # masked scores are constants
            dq[:, rows] = torch.einsum("hgqk,hkd->hgqd", ds, kf).reshape(heads, -1, dim)
            dk += torch.einsum("hgqk,hgqd->hkd", ds, qg)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None


def merge_blocks(outs: list[torch.Tensor], lses: list[torch.Tensor]) -> torch.Tensor:
    """The attention over the union of the blocks' keys from each block's output (H, tq, D) and log-sum-exp
    (H, tq): out = sum_i exp(lse_i - lse) out_i with lse = log sum_i exp(lse_i) (the online-softmax rule)."""
    lse = torch.logsumexp(torch.stack(lses), dim=0)
    return sum(torch.exp(part - lse)[..., None] * o for part, o in zip(lses, outs))


def ring_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers attention function: query (1, H, t, D), key/value (1, Hkv, t, D) of this rank's tokens ->
    ((1, t, H, D), None); key/value chunks go around the group, blocks merged by their log-sum-exp."""
    ctx: SequenceContext = kwargs.pop("fastdpo_sp")
    window = getattr(module, "_fastdpo_window", None)
    attention.check_window(kwargs, window)
    if dropout and module.training:
        raise FastDPOError(f"the model's attention dropout ({dropout}) is not applied by ring attention's blocks. "
                           "Use --sequence_parallel_mode ulysses, or a config with attention_dropout 0.")
    n, r = ctx.size, ctx.rank
    q = query.squeeze(0)  # a view in the backward too ([0]'s backward writes a zeroed copy)
    scale = scaling if scaling is not None else q.shape[-1] ** -0.5
    kv = torch.cat([key.squeeze(0), value.squeeze(0)])  # one message per shift: (2 Hkv, t, D)
    outs, lses = [], []
    unused = []  # chunks no block read: kept in the graph so every rank runs every shift's backward
    for s in range(n):
        if s:
            kv = _RingShift.apply(kv, ctx.group, ctx.ranks[(r + 1) % n], ctx.ranks[(r - 1) % n])
        if not ctx.blocks[s]:
            unused.append(kv)
            continue
        k, v = kv.chunk(2)
        o, lse = BlockAttention.apply(q, k, v, ctx.meta[r], ctx.meta[(r - s) % n], window, scale)
        outs.append(o)
        lses.append(lse)
    out = merge_blocks(outs, lses)  # block 0 (the own chunk) is always there: a token sees itself
    for chunk in unused:
        out = out + 0.0 * chunk.sum()
    return out.to(query.dtype).transpose(0, 1)[None].contiguous(), None
