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


@triton.jit
def _dot(a, b, acc, UPCAST: tl.constexpr):
    """a @ b + acc, float32 operands in full precision (not TF32, as torch's matmul by default); with UPCAST
    (Triton's interpreter, whose dot mishandles bfloat16) on the operands' float32 values, the same sum as the
    tensor cores' float32 accumulation of them."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    if a.dtype == tl.float32:
        return tl.dot(a, b, acc, input_precision="ieee")
    return tl.dot(a, b, acc)


DROPOUT_ROUNDS = tl.constexpr(7)


@triton.jit
def _kept(seed, rows, k0, K, threshold, BLOCK_K: tl.constexpr):
    """Which elements of rows `rows`, columns k0 .. k0 + BLOCK_K of a (M, K) input dropout keeps (k0 a multiple of 8):
    one Philox call per eight columns (keyed by the call's seed and the group's index) gives four 32-bit words, and
    each column takes one 16-bit half of one of them; an element is kept when its half reaches `threshold` (p * 2**16,
    rounded). Every kernel of one call thus draws the same mask without storing it. Philox runs `DROPOUT_ROUNDS`
    rounds, not Triton's default 10, and each word serves two elements: the kernels' integer work is most of their
    time, and a dropout mask needs no cryptographic margin."""
    groups = rows[:, None] * tl.cdiv(K, 8) + (k0 // 8 + tl.arange(0, BLOCK_K // 8))[None, :]
    r0, r1, r2, r3 = tl.randint4x(seed, groups, DROPOUT_ROUNDS)
    r = tl.interleave(tl.interleave(r0, r2), tl.interleave(r1, r3)).to(tl.uint32, bitcast=True)  # word of 2 columns
    halves = tl.interleave(r & 0xFFFF, r >> 16)  # column j: half j % 2 of word j // 2
    return halves.to(tl.int32) >= threshold


@triton.jit(do_not_specialize=["seed", "M"])
def _lora_keep(seed, OUT, M, K, threshold, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """The mask the kernels below apply, as int8 (M, K): what the tests compare them with."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    k0 = tl.program_id(1) * BLOCK_K
    cols = k0 + tl.arange(0, BLOCK_K)
    keep = _kept(seed, rows, k0, K, threshold, BLOCK_K)
    tl.store(OUT + rows[:, None] * K + cols[None, :], keep.to(tl.int8), mask=(rows < M)[:, None] & (cols < K)[None, :])


@triton.jit(do_not_specialize=["seed", "M"])
def _lora_drop_down(X, A, seed, T, M, K, R, threshold, inv_keep, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
                    BLOCK_R: tl.constexpr, UPCAST: tl.constexpr):
    """T (M, R) = dropout(X) @ A^T for X (M, K) and A (R, K) of X's dtype: the dropped input, each element rounded
    to the dtype as x * mask / (1 - p) is, lives in registers only; float32 accumulation."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    ranks = tl.arange(0, BLOCK_R)
    rmask = rows < M
    acc = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        cmask = cols < K
        x = tl.load(X + rows[:, None] * K + cols[None, :], mask=rmask[:, None] & cmask[None, :], other=0.0)
        keep = _kept(seed, rows, k0, K, threshold, BLOCK_K)
        xd = tl.where(keep, x.to(tl.float32) * inv_keep, 0.0).to(x.dtype)
        a = tl.load(A + ranks[None, :] * K + cols[:, None], mask=cmask[:, None] & (ranks < R)[None, :], other=0.0)
        acc = _dot(xd, a, acc, UPCAST)
    tl.store(T + rows[:, None] * R + ranks[None, :], acc.to(T.dtype.element_ty),
             mask=rmask[:, None] & (ranks < R)[None, :])


@triton.jit(do_not_specialize=["seed", "M"])
def _lora_drop_dx(GT, A, seed, DX, M, K, R, threshold, coef, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
                  BLOCK_R: tl.constexpr, UPCAST: tl.constexpr):
    """DX (M, K) = ((GT @ A) * mask) * coef for GT (M, R) and A (R, K): the input's gradient through the adapter
    (coef: the adapter's scale over 1 - p), in float32 and rounded once."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    k0 = tl.program_id(1) * BLOCK_K
    cols = k0 + tl.arange(0, BLOCK_K)
    ranks = tl.arange(0, BLOCK_R)
    rmask, cmask, kmask = rows < M, cols < K, ranks < R
    gt = tl.load(GT + rows[:, None] * R + ranks[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0)
    a = tl.load(A + ranks[:, None] * K + cols[None, :], mask=kmask[:, None] & cmask[None, :], other=0.0)
    v = _dot(gt, a, tl.zeros([BLOCK_M, BLOCK_K], dtype=tl.float32), UPCAST)
    d = tl.where(_kept(seed, rows, k0, K, threshold, BLOCK_K), v * coef, 0.0)
    tl.store(DX + rows[:, None] * K + cols[None, :], d.to(DX.dtype.element_ty), mask=rmask[:, None] & cmask[None, :])


@triton.jit(do_not_specialize=["seed", "M", "rows_per_program"])
def _lora_drop_da(GT, X, seed, P, M, K, R, threshold, inv_keep, rows_per_program, BLOCK_M: tl.constexpr,
                  BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr, UPCAST: tl.constexpr):
    """P[s] (R, K) = GT[rows of s]^T @ dropout(X)[rows of s], float32: program (k, s) sums its span of rows for
    one block of columns; the caller sums the spans (no atomics: the same sum every run)."""
    k0 = tl.program_id(0) * BLOCK_K
    cols = k0 + tl.arange(0, BLOCK_K)
    span = tl.program_id(1)
    ranks = tl.arange(0, BLOCK_R)
    cmask, kmask = cols < K, ranks < R
    acc = tl.zeros([BLOCK_R, BLOCK_K], dtype=tl.float32)
    start = span * rows_per_program
    for i in range(0, rows_per_program, BLOCK_M):
        rows = start + i + tl.arange(0, BLOCK_M)
        rmask = (rows < M) & (rows < start + rows_per_program)
        x = tl.load(X + rows[:, None] * K + cols[None, :], mask=rmask[:, None] & cmask[None, :], other=0.0)
        keep = _kept(seed, rows, k0, K, threshold, BLOCK_K)
        xd = tl.where(keep, x.to(tl.float32) * inv_keep, 0.0).to(x.dtype)
        gt = tl.load(GT + rows[None, :] * R + ranks[:, None], mask=kmask[:, None] & rmask[None, :], other=0.0)
        acc = _dot(gt, xd, acc, UPCAST)
    tl.store(P + span * R * K + ranks[:, None] * K + cols[None, :], acc, mask=kmask[:, None] & cmask[None, :])
