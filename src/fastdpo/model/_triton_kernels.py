"""The Triton kernels behind `fastdpo.model.kernels`, in a module of their own: importing Triton takes a few seconds,
paid only by runs that use them (on first use, or by the build thread while training loads)."""

import triton
import triton.language as tl


@triton.jit(do_not_specialize=["M"])
def _rms_fwd(X, W, Y, R, M, N, eps, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    rmask = rows < M
    mask = rmask[:, None] & (cols < N)[None, :]
    offs = rows[:, None].to(tl.int64) * N + cols[None, :]
    x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=1) / N + eps)
    w = tl.load(W + cols, mask=cols < N, other=0.0).to(tl.float32)
    n = (x * rstd[:, None]).to(Y.dtype.element_ty).to(tl.float32)  # the module rounds before the weight
    tl.store(Y + offs, (n * w[None, :]).to(Y.dtype.element_ty), mask=mask)
    tl.store(R + rows, rstd, mask=rmask)

@triton.jit(do_not_specialize=["M", "rows_per_program"])
def _rms_bwd(G, X, W, R, DX, DW, M, N, rows_per_program, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
             WEIGHT_GRAD: tl.constexpr):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    cmask = cols < N
    w = tl.load(W + cols, mask=cmask, other=0.0).to(tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    start = pid * rows_per_program
    for i in range(0, rows_per_program, BLOCK_M):
        rows = start + i + tl.arange(0, BLOCK_M)
        rmask = rows < M
        mask = rmask[:, None] & cmask[None, :]
        offs = rows[:, None].to(tl.int64) * N + cols[None, :]
        x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
        g = tl.load(G + offs, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(R + rows, mask=rmask, other=0.0)
        n = x * rstd[:, None]
        if WEIGHT_GRAD:
            acc += g * n.to(X.dtype.element_ty).to(tl.float32)
        gn = g * w[None, :]
        dot = tl.sum(gn * n, axis=1) / N
        dx = rstd[:, None] * (gn - n * dot[:, None])
        tl.store(DX + offs, dx.to(DX.dtype.element_ty), mask=mask)
    if WEIGHT_GRAD:
        tl.store(DW + pid.to(tl.int64) * N + cols, tl.sum(acc, axis=0), mask=cmask)

@triton.jit(do_not_specialize=["numel"])
def _silu_mul_fwd(A, B, P, numel, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    a = tl.load(A + offs, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(B + offs, mask=mask, other=0.0).to(tl.float32)
    act = (a * tl.sigmoid(a)).to(P.dtype.element_ty).to(tl.float32)  # silu's result in the dtype, as eager
    tl.store(P + offs, (act * b).to(P.dtype.element_ty), mask=mask)

@triton.jit(do_not_specialize=["numel"])
def _silu_mul_bwd(A, B, G, DA, DB, P, numel, BLOCK: tl.constexpr, PRODUCT: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    a = tl.load(A + offs, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(B + offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(G + offs, mask=mask, other=0.0).to(tl.float32)
    s = tl.sigmoid(a)
    act = a * s
    tl.store(DB + offs, (g * act).to(DB.dtype.element_ty), mask=mask)
    tl.store(DA + offs, (g * b * s * (1.0 + a * (1.0 - s))).to(DA.dtype.element_ty), mask=mask)
    if PRODUCT:
        act_r = act.to(P.dtype.element_ty).to(tl.float32)
        tl.store(P + offs, (act_r * b).to(P.dtype.element_ty), mask=mask)

@triton.jit(do_not_specialize=["T", "S", "H", "sx_b", "sc_b"])
def _rope(X, C, SN, Y, T, S, H, sx_b, sx_s, sx_h, sc_b, sc_s, HALF: tl.constexpr, BLOCK_T: tl.constexpr,
          BLOCK_D: tl.constexpr, BACKWARD: tl.constexpr):
    """Rotate half of every head: forward y = x * cos + rotate_half(x) * sin, backward its transpose (the gradient
    rotated by -sin). X is (B, S, H, D) through its strides (D contiguous), C and SN are (B or 1, S, D); Y is
    contiguous (B, S, H, D). Tokens index B * S."""
    tok = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    d = tl.arange(0, BLOCK_D)
    tmask = tok < T
    mask = tmask[:, None] & (d < HALF)[None, :]
    b = (tok // S).to(tl.int64)
    s = (tok % S).to(tl.int64)
    c_off = (b * sc_b + s * sc_s)[:, None] + d[None, :]
    c1 = tl.load(C + c_off, mask=mask, other=0.0).to(tl.float32)
    c2 = tl.load(C + c_off + HALF, mask=mask, other=0.0).to(tl.float32)
    s1 = tl.load(SN + c_off, mask=mask, other=0.0).to(tl.float32)
    s2 = tl.load(SN + c_off + HALF, mask=mask, other=0.0).to(tl.float32)
    x_base = (b * sx_b + s * sx_s)[:, None] + d[None, :]
    y_base = tok.to(tl.int64)[:, None] * (H * 2 * HALF) + d[None, :]
    for h in range(H):
        x1 = tl.load(X + x_base + h * sx_h, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(X + x_base + h * sx_h + HALF, mask=mask, other=0.0).to(tl.float32)
        if BACKWARD:
            y1 = x1 * c1 + x2 * s2
            y2 = x2 * c2 - x1 * s1
        else:
            y1 = x1 * c1 - x2 * s1
            y2 = x2 * c2 + x1 * s2
        tl.store(Y + y_base + h * (2 * HALF), y1.to(Y.dtype.element_ty), mask=mask)
        tl.store(Y + y_base + h * (2 * HALF) + HALF, y2.to(Y.dtype.element_ty), mask=mask)

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


@triton.jit(do_not_specialize=["W"])
def _gather_rows_bwd(G, FIRST, SECOND, DX, W, BLOCK: tl.constexpr):
    """One row of DX per program: G[first] + G[second] (the second when there is one, >= 0), summed in float32."""
    row = tl.program_id(0).to(tl.int64)
    i1 = tl.load(FIRST + row)  # every row is taken at least once
    i2 = tl.load(SECOND + row)
    twice = i2 >= 0
    i2 = tl.maximum(i2, 0)
    for start in range(0, W, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        keep = cols < W
        acc = tl.load(G + i1 * W + cols, mask=keep, other=0.0).to(tl.float32)
        acc += tl.where(twice, tl.load(G + i2 * W + cols, mask=keep, other=0.0).to(tl.float32), 0.0)
        tl.store(DX + row * W + cols, acc.to(DX.dtype.element_ty), mask=keep)
