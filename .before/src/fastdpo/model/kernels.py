"""Triton kernels for the lean norms, MLPs, rotary embeddings and the log-prob head: one pass over memory where
eager PyTorch takes five to ten.

Eager RMSNorm upcasts, squares, averages, scales, downcasts and multiplies by the weight: about 36 bytes moved per
element in the forward and more in the backward. The kernels here read the input once and write the result once
(4 bytes per bfloat16 element forward, 6 backward plus the weight's partial sums), with all arithmetic in float32.
The SwiGLU product is one pass forward, and one backward that also rebuilds the product for the down projection's
gradient. The log-prob head reads a chunk of logits once, in the GEMM's dtype, for each row's log-sum-exp and
target log-prob, and its backward writes the logits' gradient over them in one pass; eager upcasts the chunk to
float32 and takes a softmax, a scatter, a scale and a downcast.

No kernel depends on the number of tokens: that count is not specialised on (`do_not_specialize`), so a run builds
each kernel once per width and dtype, however its micro-batch lengths vary. Outside CUDA the kernels run under
Triton's interpreter (TRITON_INTERPRET=1, which the tests use); `available(t)` says whether they serve a tensor."""

from __future__ import annotations

import functools
import importlib
import importlib.util
import logging
import math
import os
import threading

import torch

HAVE_TRITON = importlib.util.find_spec("triton") is not None  # the CPU wheel of torch brings none: the torch path
_lock = threading.Lock()

log = logging.getLogger("fastdpo")

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def available(t: torch.Tensor) -> bool:
    """The kernels serve `t`: Triton is installed, and `t` lives on CUDA (or on the CPU under the interpreter)."""
    return HAVE_TRITON and not _failed and t.dtype in DTYPES and (t.is_cuda or (INTERPRET and t.device.type == "cpu"))


_jitted = None


def jitted():
    """The module of the jitted kernels (`_triton_kernels`), imported on first use (then held: no lock per launch)."""
    global _jitted
    if _jitted is None:
        with _lock:
            _jitted = importlib.import_module("fastdpo.model._triton_kernels")
    return _jitted


_LAUNCH_FORM = ("kernel.run(grid_0, grid_1, grid_2, stream, kernel.function, kernel.packed_metadata, "
                "launch_metadata,")
_knobs = None  # Triton's settings module, once direct launches are known to be possible


@functools.cache
def _direct_launches() -> bool:
    """Whether compiled kernels can be launched here as Triton's own dispatch launches them (its `JITFunction.run`
    ends with that call, in the form `launch` repeats): checked once, on Triton's source. Otherwise every launch
    goes through Triton's dispatch."""
    global _knobs
    if INTERPRET or not HAVE_TRITON:
        return False
    try:
        import inspect

        from triton import knobs
        from triton.runtime.jit import JITFunction

        if _LAUNCH_FORM not in " ".join(inspect.getsource(JITFunction.run).split()):
            return False
    except Exception:  # noqa: BLE001 - no source to check (or another Triton): its dispatch
        return False
    _knobs = knobs
    return True


def _arg_key(v) -> object:
    """What Triton specialises a kernel argument on, or more (over-keying only adds entries that share a kernel):
    a tensor's dtype and 16-byte alignment, an int's equality to 1, divisibility by 16 and width, a float's type."""
    if isinstance(v, torch.Tensor):
        return v.dtype, v.data_ptr() % 16 == 0
    if isinstance(v, bool):
        return "b", v
    if isinstance(v, int):
        return v == 1, v % 16 == 0, 0 if -2**31 <= v < 2**31 else 1 if -2**63 <= v < 2**63 else 2
    if isinstance(v, float):
        return float
    raise TypeError(type(v))


def _constants(kernel, args: tuple, constexprs: dict) -> tuple | None:
    """The kernel's parameters after the positional `args`, in its own order, when `constexprs` names exactly those
    (then every argument of the launch is known); else None."""
    names = list(getattr(kernel, "arg_names", ()))
    rest = names[len(args):]
    if len(names) < len(args) or sorted(rest) != sorted(constexprs):
        return None
    return tuple(constexprs[n] for n in rest)


_compiled: dict[tuple, tuple] = {}


def launch(kernel, grid: tuple[int, ...], *args, num_warps: int = 4, **constexprs) -> None:
    """`kernel[grid](*args, num_warps=num_warps, **constexprs)` with less host work per call. Triton's dispatch
    binds the arguments, computes its cache key, reads its settings and looks up the stream: about 15 µs of Python
    per launch, measured on an H200's host, and a training step makes hundreds of these launches. The first call
    with a given specialisation (`_arg_key` of each argument, the constants, the warps, the device) goes through
    Triton, which compiles or loads the kernel; later calls hand every argument straight to the compiled kernel's
    launcher, on the current stream, as Triton's dispatch does after its lookup."""
    if not _direct_launches():
        kernel[grid](*args, num_warps=num_warps, **constexprs)
        return
    device = torch.cuda.current_device()
    try:
        key = (kernel, device, num_warps, tuple(constexprs.items()), *map(_arg_key, args))
    except TypeError:  # an argument kind the key does not know: Triton's dispatch
        kernel[grid](*args, num_warps=num_warps, **constexprs)
        return
    hit = _compiled.get(key)
    if hit is None:
        compiled = kernel[grid](*args, num_warps=num_warps, **constexprs)
        constants = _constants(kernel, args, constexprs)
        if constants is not None and all(hasattr(compiled, a) for a in ("run", "function", "packed_metadata",
                                                                        "launch_metadata")):
            _compiled[key] = compiled, constants
        return
    compiled, constants = hit
    enter, leave = _knobs.runtime.launch_enter_hook, _knobs.runtime.launch_exit_hook
    stream = torch._C._cuda_getCurrentRawStream(device)
    every = (*args, *constants)
    hooked = enter is not None and getattr(enter, "calls", True)  # a profiler's hooks want the launch's metadata
    compiled.run(grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1, stream, compiled.function,
                 compiled.packed_metadata, compiled.launch_metadata(grid, stream, *every) if hooked else None, enter,
                 leave, *every)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


@functools.cache
def _programs(device_index: int) -> int:
    if not torch.cuda.is_available():
        return 8
    return torch.cuda.get_device_properties(device_index).multi_processor_count * 4


@functools.cache
def _row_block(n: int) -> tuple[int, int]:
    """(rows per block, columns per block) for rows of width n: a block of about 4096 elements, at least one row."""
    block_n = next_power_of_2(n)
    return max(1, min(64, 4096 // block_n)), block_n


ELEMENTWISE_BLOCK = 1024  # with 16 warps, two elements per thread: 2.8 TB/s forward and 3.6 backward on an H200,
ELEMENTWISE_WARPS = 16  # where 2048 over 8 warps reached 1.8 and 1.3 (numel 51M, bf16)


def rms_norm_forward(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight * (x * rstd).to(x.dtype), rstd) over the last dimension; rstd is float32, one per row."""
    n = x.shape[-1]
    x2 = x.reshape(-1, n).contiguous()
    m = x2.shape[0]
    y = torch.empty_like(x2)
    rstd = torch.empty(m, dtype=torch.float32, device=x.device)
    block_m, block_n = _row_block(n)
    if m:
        launch(jitted()._rms_fwd, (cdiv(m, block_m),), x2, weight.contiguous(), y, rstd, m, n, eps,
               num_warps=4 if block_n <= 4096 else 8, BLOCK_M=block_m, BLOCK_N=block_n)
    return y.view(x.shape), rstd


def rms_norm_backward(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor,
                      weight_grad: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(d x, d weight or None) of `rms_norm_forward`, the weight's gradient summed in float32."""
    n = x.shape[-1]
    x2, g2 = x.reshape(-1, n).contiguous(), grad.reshape(-1, n).contiguous()
    m = x2.shape[0]
    block_m, block_n = _row_block(n)
    programs = max(1, min(_programs(x.device.index or 0) if x.is_cuda else 8, cdiv(m, block_m)))
    per = max(1, cdiv(cdiv(m, programs), block_m)) * block_m
    programs = max(1, cdiv(m, per))
    dx = torch.empty_like(x2)
    dw = torch.empty((programs, n), dtype=torch.float32, device=x.device) if weight_grad else dx
    if m:
        launch(jitted()._rms_bwd, (programs,), g2, x2, weight.contiguous(), rstd, dx, dw, m, n, per,
               num_warps=4 if block_n <= 4096 else 8, BLOCK_M=block_m, BLOCK_N=block_n, WEIGHT_GRAD=weight_grad)
    if not weight_grad:
        return dx.view(x.shape), None
    return dx.view(x.shape), (dw.sum(0) if m else torch.zeros(n, device=x.device)).to(weight.dtype)


def silu_mul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """silu(a) * b, rounded as eager rounds it (silu's result in the dtype, then the product)."""
    a, b = a.contiguous(), b.contiguous()
    p = torch.empty_like(a)
    numel = a.numel()
    if numel:
        launch(jitted()._silu_mul_fwd, (cdiv(numel, ELEMENTWISE_BLOCK),), a, b, p, numel, num_warps=ELEMENTWISE_WARPS,
               BLOCK=ELEMENTWISE_BLOCK)
    return p


def silu_mul_backward(a: torch.Tensor, b: torch.Tensor, grad: torch.Tensor, product: bool = False
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(d a, d b, and with `product` silu(a) * b again) for the gradient `grad` of silu(a) * b: one pass."""
    a, b, grad = a.contiguous(), b.contiguous(), grad.contiguous()
    da, db = torch.empty_like(a), torch.empty_like(b)
    p = torch.empty_like(a) if product else da
    numel = a.numel()
    if numel:
        launch(jitted()._silu_mul_bwd, (cdiv(numel, ELEMENTWISE_BLOCK),), a, b, grad, da, db, p, numel,
               num_warps=ELEMENTWISE_WARPS, BLOCK=ELEMENTWISE_BLOCK, PRODUCT=product)
    return da, db, (p if product else None)


def silu_mul_grads_torch(gate: torch.Tensor, up: torch.Tensor, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`silu_mul_backward`'s gradients in eager torch (any device): of silu(gate) * up with respect to gate and up,
    computed in float32, returned in their dtypes."""
    gf = gate.to(torch.float32)
    s = torch.sigmoid(gf)
    g = grad.to(torch.float32)
    g_up = (g * (gf * s)).to(up.dtype)
    g_gate = (g * up.to(torch.float32) * s * (1 + gf * (1 - s))).to(gate.dtype)
    return g_gate, g_up


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
        launch(jitted()._logp_fwd, (n,), logits, targets.contiguous(), out, lse, v, logits.stride(0), scale, num_warps=8,
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
        launch(jitted()._logp_bwd, (n,), logits, targets.contiguous(), grad.float().contiguous(), lse.contiguous(), v,
               logits.stride(0), scale, num_warps=8, BLOCK=LOGP_BLOCK)
    return logits


GATHER_BLOCK = 1024  # elements of a row per inner iteration, whatever the width: one build serves every model


def gather_rows_backward(grad: torch.Tensor, first: torch.Tensor, second: torch.Tensor) -> torch.Tensor:
    """The gradient of x.index_select(0, index) with respect to x when each row of x was taken once or twice, at
    `first` and `second` (-1: taken once; (T,) long each): grad[first] + grad[second], summed in float32 and rounded
    once, without atomics. grad (K, ...) -> (T, ...)."""
    g = grad.contiguous()
    rows, width = first.numel(), math.prod(g.shape[1:])
    out = torch.empty((rows, *g.shape[1:]), dtype=g.dtype, device=g.device)
    if rows and width:
        launch(jitted()._gather_rows_bwd, (rows,), g, first.contiguous(), second.contiguous(), out, width, num_warps=4,
               BLOCK=GATHER_BLOCK)
    return out


ROPE_TOKENS = 16


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backward: bool = False) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin for x of shape (B, H, S, D) (any strides, D contiguous) and cos, sin of shape
    (B or 1, S, D), in float32 and rounded once; with `backward`, the gradient's rotation back (by -sin). The result
    is laid out as (B, S, H, D) and returned transposed to (B, H, S, D), the layout the projections give."""
    b, h, s, d = x.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    cos, sin = cos.expand(-1, s, d), sin.expand(-1, s, d)
    if cos.stride(-1) != 1 or sin.stride() != cos.stride():
        cos, sin = cos.contiguous(), sin.contiguous()
    y = torch.empty((b, s, h, d), dtype=x.dtype, device=x.device)
    t = b * s
    if t:
        launch(jitted()._rope, (cdiv(t, ROPE_TOKENS),), x, cos, sin, y, t, s, h, x.stride(0), x.stride(2), x.stride(1),
               cos.stride(0) if cos.shape[0] > 1 else 0, cos.stride(1), num_warps=4, HALF=d // 2, BLOCK_T=ROPE_TOKENS,
               BLOCK_D=next_power_of_2(d // 2), BACKWARD=backward)
    return y.transpose(1, 2)


LORA_MAX_RANK = 128  # above it the LoRA dropout kernels' register tiles grow too large: the torch path serves
LORA_BLOCK_M, LORA_BLOCK_K = 32, 128
LORA_DOWN_BLOCK_M = 16  # x @ A^T: one program per 16 rows, so that a few thousand rows keep every SM busy


def lora_dropout_threshold(p: float) -> int:
    """The kernels keep an element when its 16 random bits reach this: a drop probability of p to the nearest
    multiple of 2**-16 (within 7.7e-6 of p; 0.05 draws 0.0500031), and never 0 for a p above 0. The kept elements are
    scaled by 1 / (1 - p), as torch's dropout scales them."""
    return max(round(p * 2**16), 1) if p > 0 else 0


def _upcast(t: torch.Tensor) -> bool:
    return INTERPRET and t.dtype != torch.float32


def lora_rank_block(rank: int) -> int:
    return max(16, next_power_of_2(rank))  # tl.dot's smallest side


def lora_dropout_serves(x: torch.Tensor, rank: int) -> bool:
    """The LoRA dropout kernels serve a (M, K) input `x` for an adapter of `rank`: `available(x)`, a rank they
    hold in registers, and fewer than 2**31 elements (the masks are keyed by an element's int32 index)."""
    return available(x) and x.dim() == 2 and rank <= LORA_MAX_RANK and x.numel() < 2**31


def lora_dropout_seed() -> int:
    """A 31-bit seed from torch's CPU generator (no device work, no sync): what keys one call's masks. A recompute
    that restores the generator's state draws the same seed, hence the same masks."""
    return int(torch.randint(2**31 - 1, (1,)).item())


def lora_dropout_keep(seed: int, shape: tuple[int, int], p: float, device: torch.device) -> torch.Tensor:
    """The bool mask (M, K) that the LoRA dropout kernels apply for `seed` and drop probability `p`."""
    m, k = shape
    out = torch.empty((m, k), dtype=torch.int8, device=device)
    if out.numel():
        launch(jitted()._lora_keep, (cdiv(m, LORA_BLOCK_M), cdiv(k, LORA_BLOCK_K)), seed, out, m, k,
               lora_dropout_threshold(p), num_warps=4, BLOCK_M=LORA_BLOCK_M, BLOCK_K=LORA_BLOCK_K)
    return out.bool()


def lora_dropout_down(x: torch.Tensor, a: torch.Tensor, seed: int, p: float) -> torch.Tensor:
    """(x * mask / (1 - p)) @ a^T for x (M, K) and a (R, K) of x's dtype, the mask drawn from `seed` and never
    stored: (M, R) in x's dtype, float32 accumulation."""
    m, k = x.shape
    r = a.shape[0]
    x, a = x.contiguous(), a.contiguous()
    t = torch.empty((m, r), dtype=x.dtype, device=x.device)
    if m:
        launch(jitted()._lora_drop_down, (cdiv(m, LORA_DOWN_BLOCK_M),), x, a, seed, t, m, k, r,
               lora_dropout_threshold(p), 1.0 / (1.0 - p), num_warps=4, BLOCK_M=LORA_DOWN_BLOCK_M, BLOCK_K=LORA_BLOCK_K,
               BLOCK_R=lora_rank_block(r), UPCAST=_upcast(x))
    return t


def lora_dropout_input_grad(gt: torch.Tensor, a: torch.Tensor, seed: int, p: float,
                            scale: float) -> torch.Tensor:
    """The gradient of `lora_dropout_down`'s x for the gradient `gt` (M, R) of its output, times `scale`:
    ((gt @ a) * mask) * scale / (1 - p), (M, K) in gt's dtype, rounded once."""
    m, r = gt.shape
    k = a.shape[1]
    gt, a = gt.contiguous(), a.contiguous()
    dx = torch.empty((m, k), dtype=gt.dtype, device=gt.device)
    if m and k:
        grid = (cdiv(m, LORA_BLOCK_M), cdiv(k, LORA_BLOCK_K))
        launch(jitted()._lora_drop_dx, grid, gt, a, seed, dx, m, k, r, lora_dropout_threshold(p), scale / (1.0 - p),
               num_warps=4, BLOCK_M=LORA_BLOCK_M, BLOCK_K=LORA_BLOCK_K, BLOCK_R=lora_rank_block(r), UPCAST=_upcast(gt))
    return dx


def lora_dropout_weight_grad(gt: torch.Tensor, x: torch.Tensor, seed: int, p: float) -> torch.Tensor:
    """gt^T @ (x * mask / (1 - p)): the gradient of `lora_dropout_down`'s a for the gradient `gt` (M, R) of its
    output, (R, K) in float32. Spans of rows are summed by programs of their own, then added (no atomics)."""
    m, r = gt.shape
    k = x.shape[1]
    gt, x = gt.contiguous(), x.contiguous()
    col_blocks = cdiv(k, LORA_BLOCK_K)
    spans = max(1, min(cdiv(m, LORA_BLOCK_M), cdiv(_programs(x.device.index or 0) if x.is_cuda else 8, col_blocks)))
    per = cdiv(cdiv(m, spans), LORA_BLOCK_M) * LORA_BLOCK_M if m else LORA_BLOCK_M
    spans = max(1, cdiv(m, per))
    parts = torch.empty((spans, r, k), dtype=torch.float32, device=x.device)
    if not m:
        return parts.zero_().sum(0)
    launch(jitted()._lora_drop_da, (col_blocks, spans), gt, x, seed, parts, m, k, r, lora_dropout_threshold(p),
           1.0 / (1.0 - p), per, num_warps=4, BLOCK_M=LORA_BLOCK_M, BLOCK_K=LORA_BLOCK_K, BLOCK_R=lora_rank_block(r),
           UPCAST=_upcast(x))
    return parts.sum(0) if spans > 1 else parts[0]


def _text_config(config):
    return getattr(config, "text_config", None) or config


def head_size(config) -> int | None:
    """The attention head size of a model's config (what its rotary embedding rotates)."""
    text = _text_config(config)
    hidden, heads = getattr(text, "hidden_size", None), getattr(text, "num_attention_heads", None)
    return getattr(text, "head_dim", None) or (hidden // heads if hidden and heads else None)


def norm_widths(config) -> list[int]:
    """The widths a model's norms take: the hidden size, and the head size (Qwen3's per-head query and key norms)."""
    hidden = getattr(_text_config(config), "hidden_size", None)
    if not hidden:
        return []
    head_dim = head_size(config)
    return list(dict.fromkeys([hidden] + ([head_dim] if head_dim else [])))


_builds: dict[tuple, threading.Thread] = {}
_failed: list[str] = []  # why the kernels could not be built here (then nothing uses them)


def _launches(widths: list[int], dtype: torch.dtype, device: torch.device, head_dim: int | None,
              lora: bool | None, dropout_rank: int = 0) -> list:
    """Every kernel launch a model of these norm widths and head size trains with, as thunks on tiny inputs: each
    builds its kernel as training would (the same dtypes, constants and specialisations). `lora`: True (LoRA: the
    norms' weights are frozen), False (full fine-tuning: they train, and the down projections are plain), None (both
    kinds). `dropout_rank`: the rank of LoRA adapters trained with dropout, whose kernels are built too (0: none).
    A launch left out only means its kernel is built when first used."""
    z = functools.partial(torch.zeros, dtype=dtype, device=device)
    grads = (False,) if lora else (True,) if lora is False else (True, False)
    products = (True,) if lora is False else (True, False)  # a plain down projection, or one LoRA wraps
    out = []
    for n in widths:
        x, w, r = z(2, n), z(n) + 1, torch.ones(2, dtype=torch.float32, device=device)
        out.append(functools.partial(rms_norm_forward, x, w, 1e-6))
        out += [functools.partial(rms_norm_backward, x, x, w, r, g) for g in grads]
    a = z(16)
    out.append(functools.partial(silu_mul, a, a))
    out += [functools.partial(silu_mul_backward, a, a, a, p) for p in products]
    logits, t, f = z(2, 16), torch.zeros(2, dtype=torch.long, device=device), torch.zeros(2, device=device)
    out += [functools.partial(logp_forward, logits, t, 1.0), functools.partial(logp_backward_, logits, t, f, f, 1.0)]
    idx = torch.zeros(2, dtype=torch.long, device=device)
    out.append(functools.partial(gather_rows_backward, z(2, 16), idx, idx - 1))
    if head_dim and head_dim % 2 == 0:  # the projections' layout: (B, S, H, D) seen as (B, H, S, D)
        q, c = z(1, 3, 2, head_dim).transpose(1, 2), z(1, 3, head_dim)
        out += [functools.partial(rope, q, c, c, b) for b in (False, True)]
    if 0 < dropout_rank <= LORA_MAX_RANK:  # widths that are multiples of 16 (Triton specialises on it), as models'
        x, a, gt = z(2, 64), z(dropout_rank, 64), z(2, dropout_rank)
        out += [functools.partial(lora_dropout_down, x, a, 1, 0.5),
                functools.partial(lora_dropout_input_grad, gt, a, 1, 0.5, 1.0),
                functools.partial(lora_dropout_weight_grad, gt, x, 1, 0.5)]
    return out


def _build(widths: list[int], dtype: torch.dtype, device: torch.device, head_dim: int | None, lora: bool | None,
           dropout_rank: int = 0) -> None:
    """Run the launches of `_launches` once."""
    for launch in _launches(widths, dtype, device, head_dim, lora, dropout_rank):
        launch()
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def build_ahead(widths: list[int], dtype: torch.dtype, device: torch.device, head_dim: int | None = None,
                lora: bool | None = None, dropout_rank: int = 0) -> threading.Thread | None:
    """Build every kernel a model of these norm `widths`, `head_dim` and `dtype` trains with (`lora` and
    `dropout_rank`: see `_launches`), on a background thread, while the main thread reads data and loads weights: on
    a machine with empty caches the builds (and Triton's launcher code for each) take several seconds, which the
    first forward would otherwise wait for. `ready` waits for it and tells whether the kernels can be used."""
    if not HAVE_TRITON or dtype not in DTYPES or not (device.type == "cuda" or (INTERPRET and device.type == "cpu")):
        return None
    key = (tuple(widths), dtype, str(device), head_dim, lora, dropout_rank)
    if key in _builds:
        return _builds[key]

    def build() -> None:
        try:
            if device.type == "cuda":
                with torch.cuda.device(device):
                    _build(widths, dtype, device, head_dim, lora, dropout_rank)
            else:
                _build(widths, dtype, device, head_dim, lora, dropout_rank)
        except Exception as e:  # noqa: BLE001 - any failure means: do not use them; `ready` says why
            _failed.append(f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")

    thread = threading.Thread(target=build, name="fastdpo-kernel-builds", daemon=True)
    _builds[key] = thread
    thread.start()
    return thread


def ready(widths: list[int], dtype: torch.dtype, device: torch.device, head_dim: int | None = None,
          lora: bool | None = None, dropout_rank: int = 0) -> str | None:
    """Wait until the kernels for these widths are built (by `build_ahead`'s thread, or now); None when they serve,
    else why not (after which `available` says no)."""
    thread = build_ahead(widths, dtype, device, head_dim, lora, dropout_rank)
    if thread is None:
        return "Triton is not installed, or the device or dtype is not one the kernels serve"
    thread.join()
    return _failed[0] if _failed else None

