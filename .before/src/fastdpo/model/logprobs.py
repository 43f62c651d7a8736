"""Completion log-probs without materialising B x T x V logits (DESIGN §4).

Hidden states are gathered at target positions only, projected through `lm_head` a chunk at a time with a float32
log-sum-exp, and summed per sequence. The backward pass recomputes each chunk's logits, so only one chunk of logits
is alive at any moment in forward or backward. With `kernels` (a head the Triton kernels serve, no soft-capping) a
chunk's logits stay in the GEMM's dtype: one kernel reads them for the log-sum-exp and the target's log-prob, and
the backward's kernel writes their gradient over them (`fastdpo.model.kernels.logp_forward`, `logp_backward_`).
"""

from __future__ import annotations

import functools

import torch

from fastdpo.model import kernels as _kernels

DEFAULT_CHUNK = 1024  # rows of fp32 logits alive at once: 1024 x 152k vocab = 0.6 GiB


def _grad_into(dw: torch.Tensor | None, dlogits: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """dw + dlogits^T @ h in float32 (dw None: the first chunk). On CUDA the GEMM takes bf16/fp16 inputs and writes
    float32, adding into dw in its epilogue: one pass, no rounded per-chunk product and no separate add kernel
    (`torch.mm`/`addmm` with `out_dtype`, torch >= 2.8). Elsewhere the product is formed in the inputs' dtype and
    added."""
    if dlogits.is_cuda and dlogits.dtype in (torch.bfloat16, torch.float16) and has_out_dtype():
        if dw is None:
            return torch.mm(dlogits.t(), h, out_dtype=torch.float32)
        return torch.addmm(dw, dlogits.t(), h, out_dtype=torch.float32, out=dw)
    product = (dlogits.t() @ h).float()
    return product if dw is None else dw.add_(product)


@functools.cache
def has_out_dtype() -> bool:
    """Whether this torch's mm and addmm take `out_dtype` (bf16/fp16 inputs, a float32 result on CUDA)."""
    return hasattr(torch.ops.aten.mm, "dtype") and hasattr(torch.ops.aten.addmm, "dtype_out")


def _chunk_logits(h: torch.Tensor, weight: torch.Tensor, scale: float, softcap: float | None) -> tuple:
    raw = (h @ weight.t()).float()
    if scale != 1.0:
        raw = raw * scale
    if softcap:
        capped = torch.tanh(raw / softcap)
        return capped * softcap, capped
    return raw, None


class _TokenLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk, scale, softcap, kernels):
        fused = kernels and softcap is None and _kernels.available(hidden) and not torch.compiler.is_compiling()
        out = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        lse = torch.empty(hidden.shape[0] if fused else 0, dtype=torch.float32, device=hidden.device)
        for s in range(0, hidden.shape[0], chunk):
            if fused:
                out[s : s + chunk], lse[s : s + chunk] = _kernels.logp_forward(hidden[s : s + chunk] @ weight.t(),
                                                                               targets[s : s + chunk], scale)
                continue
            logits, _ = _chunk_logits(hidden[s : s + chunk], weight, scale, softcap)
            tgt = targets[s : s + chunk, None]
            out[s : s + chunk] = (logits.gather(1, tgt) - torch.logsumexp(logits, dim=-1, keepdim=True)).squeeze(1)
        ctx.save_for_backward(hidden, weight, targets, lse)
        ctx.chunk, ctx.scale, ctx.softcap, ctx.fused = chunk, scale, softcap, fused
        return out

    @staticmethod
    def backward(ctx, grad_out):
        hidden, weight, targets, lse = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        dh = torch.empty_like(hidden) if need_h else None
        dw = None
        for s in range(0, hidden.shape[0], ctx.chunk):
            h = hidden[s : s + ctx.chunk]
            if ctx.fused:
                dlogits = _kernels.logp_backward_(h @ weight.t(), targets[s : s + ctx.chunk], grad_out[s : s + ctx.chunk],
                                                  lse[s : s + ctx.chunk], ctx.scale)
            else:
                dlogits = _chunk_grad(h, weight, targets[s : s + ctx.chunk], grad_out[s : s + ctx.chunk], ctx.scale,
                                      ctx.softcap)
            if need_h:
                dh[s : s + ctx.chunk] = dlogits @ weight
            if need_w:
                dw = _grad_into(dw, dlogits, h)
        if need_w and dw is None:  # no rows
            dw = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        return dh, (dw.to(weight.dtype) if need_w else None), None, None, None, None, None


def _chunk_grad(h, weight, targets, grad, scale, softcap) -> torch.Tensor:
    """The gradient of one chunk's target log-probs with respect to its logits, in the hidden states' dtype."""
    logits, capped = _chunk_logits(h, weight, scale, softcap)
    g = grad[:, None].float()
    # d logp[t] / d logits = onehot(t) - softmax(logits)
    dlogits = torch.softmax(logits, dim=-1).mul_(-g)
    dlogits.scatter_add_(1, targets[:, None], g)
    if capped is not None:
        dlogits.mul_(1.0 - capped * capped)
    if scale != 1.0:
        dlogits.mul_(scale)
    return dlogits.to(h.dtype)


def token_logps(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    chunk: int = DEFAULT_CHUNK,
    scale: float = 1.0,
    softcap: float | None = None,
    kernels: bool = False,
) -> torch.Tensor:
    """log p(target | hidden) for N (hidden, target) pairs: hidden (N, H), weight (V, H), targets (N,) -> (N,) fp32.
    `kernels`: use the Triton log-prob kernels where they serve (see the module docstring)."""
    return _TokenLogProbs.apply(hidden, weight, targets, chunk, scale, softcap, kernels)


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
        logits, _ = _chunk_logits(hidden[s : s + chunk], weight, scale, softcap)
        out[s : s + chunk] = torch.logsumexp(2 * logits, dim=-1) - 2 * torch.logsumexp(logits, dim=-1)
    return out
