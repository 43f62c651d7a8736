"""Token log-probs through the output head without materialising N x V logits (DESIGN §4): log p(target | hidden)
for N (hidden, target) pairs, a chunk of rows' logits at a time.

Each chunk of hidden states is projected through the head with a float32 log-sum-exp; the backward recomputes each
chunk's logits, so only one chunk of logits is alive at any moment in forward or backward. On the kernels (a head
they serve, no soft-capping) a chunk's logits stay in the GEMM's dtype: one kernel reads them for the log-sum-exp and
the target's log-prob, and the backward's kernel writes their gradient over them in one pass, where eager upcasts
the chunk to float32 and takes a softmax, a scatter, a scale and a downcast."""

from __future__ import annotations

import torch

from fastdpo.kernels.launch import HAVE_TRITON, available, has_out_dtype, launch

if HAVE_TRITON:  # else no kernels: the eager float32 path
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["V", "stride"])
    def _logp_fwd(L, T, OUT, LSE, V, stride, scale, BLOCK: tl.constexpr):
        """One row of logits (V wide, in the GEMM's dtype) per program: its log-sum-exp in float32, online over blocks
        of the row (one read), and the target's log-prob, logits[t] * scale - lse."""
        row = tl.program_id(0).to(tl.int64)
        base = L + row * stride
        m = tl.full((), float("-inf"), tl.float32)
        s = tl.zeros((), tl.float32)
        for start in range(0, V, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            x = tl.load(base + cols, mask=cols < V, other=float("-inf")).to(tl.float32) * scale
            top = tl.maximum(m, tl.max(x, 0))
            s = s * tl.exp(m - top) + tl.sum(tl.exp(x - top), 0)
            m = top
        lse = m + tl.log(s)
        t = tl.load(T + row).to(tl.int64)
        tl.store(OUT + row, tl.load(base + t).to(tl.float32) * scale - lse)
        tl.store(LSE + row, lse)

    @triton.jit(do_not_specialize=["V", "stride"])
    def _logp_bwd(L, T, G, LSE, V, stride, scale, BLOCK: tl.constexpr):
        """In place over one row of logits per program: the gradient of logits[t] * scale - lse for the upstream
        gradient g, (onehot(t) - softmax) * g * scale, in float32 and rounded once to the logits' dtype."""
        row = tl.program_id(0).to(tl.int64)
        base = L + row * stride
        g = tl.load(G + row).to(tl.float32)
        lse = tl.load(LSE + row)
        t = tl.load(T + row).to(tl.int64)
        for start in range(0, V, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            keep = cols < V
            x = tl.load(base + cols, mask=keep, other=0.0).to(tl.float32) * scale
            d = tl.where(cols == t, g, 0.0) - g * tl.exp(x - lse)
            tl.store(base + cols, (d * scale).to(L.dtype.element_ty), mask=keep)


LOGP_BLOCK = 4096  # logits per inner iteration of the log-prob kernels


def logp_forward(logits: torch.Tensor, targets: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-prob of each row's target, each row's log-sum-exp), float32 (N,) each, of logits (N, V) times `scale`:
    one read of the logits, in their own dtype, arithmetic in float32."""
    n, v = logits.shape
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    out = torch.empty(n, dtype=torch.float32, device=logits.device)
    lse = torch.empty(n, dtype=torch.float32, device=logits.device)
    if n:
        launch(_logp_fwd, (n,), logits, targets.contiguous(), out, lse, v, logits.stride(0), scale, num_warps=8,
               BLOCK=LOGP_BLOCK)
    return out, lse


def logp_backward_(logits: torch.Tensor, targets: torch.Tensor, grad: torch.Tensor, lse: torch.Tensor,
                   scale: float) -> torch.Tensor:
    """Overwrite logits (N, V), contiguous rows, with the gradient of `logp_forward`'s log-probs for the upstream
    `grad` (N,): (onehot(target) - softmax(logits * scale)) * grad * scale, rounded once to the logits' dtype.
    Returns `logits`."""
    n, v = logits.shape
    if logits.stride(1) != 1:
        raise ValueError("logp_backward_: the logits' rows must be contiguous")
    if n:
        launch(_logp_bwd, (n,), logits, targets.contiguous(), grad.float().contiguous(), lse.contiguous(), v,
               logits.stride(0), scale, num_warps=8, BLOCK=LOGP_BLOCK)
    return logits


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


def chunk_logits(h: torch.Tensor, weight: torch.Tensor, scale: float, softcap: float | None) -> tuple:
    """(logits, tanh of the capped logits or None) of the hidden states `h` through the head `weight`: float32,
    times `scale`, soft-capped at `softcap` when one is given."""
    raw = (h @ weight.t()).float()
    if scale != 1.0:
        raw = raw * scale
    if softcap:
        capped = torch.tanh(raw / softcap)
        return capped * softcap, capped
    return raw, None


class TokenLogProbsFunction(torch.autograd.Function):
    """`token_logps`: the target log-probs of `chunk` rows at a time, keeping the hidden states, the head and (on
    the kernels) each row's log-sum-exp; the backward recomputes each chunk's logits."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk, scale, softcap, kernels):
        fused = kernels and softcap is None and available(hidden) and not torch.compiler.is_compiling()
        out = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        lse = torch.empty(hidden.shape[0] if fused else 0, dtype=torch.float32, device=hidden.device)
        for s in range(0, hidden.shape[0], chunk):
            if fused:
                out[s : s + chunk], lse[s : s + chunk] = logp_forward(hidden[s : s + chunk] @ weight.t(),
                                                                      targets[s : s + chunk], scale)
                continue
            logits, _ = chunk_logits(hidden[s : s + chunk], weight, scale, softcap)
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
                dlogits = logp_backward_(h @ weight.t(), targets[s : s + ctx.chunk], grad_out[s : s + ctx.chunk],
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
    logits, capped = chunk_logits(h, weight, scale, softcap)
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
    return TokenLogProbsFunction.apply(hidden, weight, targets, chunk, scale, softcap, kernels)
