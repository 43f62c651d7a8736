"""Varlen (Flash) attention for the packed pair layout: exactness, per-length cost, and torch.compile behaviour.

    PYTHONPATH=src python benchmarks/varlen_probe.py --part info|exact|lengths|layer|stack [--compile none|dynamic]

fastdpo packs a pair as [prompt | chosen | rejected]; rejected attends to prompt + rejected, never chosen. Here the
rule becomes two sequences per pair for `torch.nn.attention.varlen.varlen_attn`:
  - queries [prompt|chosen] over keys [prompt|chosen], causal;
  - queries [rejected] over keys [prompt|rejected], causal aligned to the bottom-right (query i of R sees key j of
    P+R when j <= i + P), which is flash attention's rule when seqlen_k > seqlen_q.
Queries stay in packed order (each pair's [p|c] and [r] runs are already contiguous), so the output is in packed
order too; keys/values take one `index_select` per layer (k index = [p|c] of the pair, then [p] again, then [r]),
whose backward sums a prompt key's two gradients. Metadata per micro-batch: k index (T + sum P,), cu_seq_q and
cu_seq_k (2B+1,) int32, max_q and max_k (host ints). Nothing depends on a compiled kernel per length.

A sliding window W (fastdpo's rule: q_pos - k_pos < W) is window_size=(W-1, 0): the key index inside each key
sequence equals the token's position id, so flash's index window is the position window.

Parts (each its own process; results as one JSON line each, printed with "RESULT " and appended to
$OUT/varlen_probe.jsonl):
  info     torch / varlen API facts (signature, custom-op registration, GQA mode)
  exact    random packed pairs incl. empty prompt and length-1 segments, GQA 16/8, windows: varlen vs a float32
           dense reference of the pair rule (output and q/k/v grads); on CPU a pure-torch emulation of
           varlen_attn's semantics stands in (checks the layout and the semantics we assume)
  lengths  6 distinct micro-batch lengths in sequence: first-call and steady fwd+bwd of varlen vs FlexAttention with
           a fresh BlockMask per length (fastdpo's own flex_block_mask and compiled flex)
  layer    a Qwen3-1.7B decoder layer under torch.compile: dynamic=True (true and bounded max lengths), static, and
           automatic dynamic; graphs compiled per new length, time of each first call
  stack    the whole 28-layer Qwen3-1.7B shape (random init, no download): time to the first optimizer step and
           per-step times over steps of new lengths, eager or with each layer compiled dynamic=True

--no_mix_order turns off Inductor's mix-order reduction (torch._inductor.config.triton.mix_order_reduction): its size
checks in the scheduler guard on ranges of T (seen on torch 2.11: 2560, 4096, 5120 for this layer), so without it a
dynamic=True layer still compiles one graph per range of lengths. On CPU, `register_cpu_kernels()` gives the
torch_attn custom ops an emulated CPU kernel so the real varlen_attn path (and torch.compile of it) runs without a GPU.

Device runs used (2026-12-01, one H200, torch 2.11.0+cu130, transformers 5.17): the parts above in three calls,
`--part stack --compile dynamic --bound 2048 [--no_mix_order]`, `--part layer [--modes dynamic_true_max
--no_mix_order]`, each part in its own process with fresh TORCHINDUCTOR_CACHE_DIR / TRITON_CACHE_DIR.
"""

# ruff: noqa: B023  (closures timed inside the loop that made them)
from __future__ import annotations

import argparse
import functools
import importlib
import inspect
import json
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass
from types import SimpleNamespace

import torch

OUT = os.environ.get("OUT") or "."
PART = "?"


def emit(rec: dict) -> None:
    rec = {"part": PART, **rec}
    line = json.dumps(rec, default=str)
    print("RESULT " + line, flush=True)
    try:
        with open(os.path.join(OUT, "varlen_probe.jsonl"), "a") as f:
            f.write(line + "\n")
    except OSError:
        pass


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


# ----------------------------------------------------------------------------------------------------------------
# workload: the anchor's length rule (log-normal; pair <= 2048)
def sample_lengths(rng: random.Random, n: int, max_total: int = 2048) -> list[tuple[int, int, int]]:
    out = []
    for _ in range(n):
        p = max(16, min(int(rng.lognormvariate(0, 0.6) * 256), 1024))
        c = max(8, min(int(rng.lognormvariate(0, 0.6) * 320), (max_total - p) - 1))
        r = max(8, min(int(rng.lognormvariate(0, 0.6) * 320), (max_total - p) - 1))
        out.append((p, c, r))
    return out


def pairs_for_tokens(rng: random.Random, target: int) -> list[tuple[int, int, int]]:
    """Pairs whose packed total is just under `target` (at least one pair)."""
    out, tot = [], 0
    while True:
        (p, c, r), = sample_lengths(rng, 1)
        if out and tot + p + c + r > target:
            return out
        out.append((p, c, r))
        tot += p + c + r


def n_tokens(lens) -> int:
    return sum(p + c + r for p, c, r in lens)


def allowed_count(lens, window: int | None = None) -> int:
    """(query, key) pairs the rule allows (for FLOP counts)."""
    tot = 0
    for p, c, r in lens:
        for sq, sk in ((p + c, p + c), (r, p + r)):
            for i in range(sq):
                last = i + sk - sq
                first = 0 if window is None else max(0, last - window + 1)
                tot += last - first + 1
    return tot


# ----------------------------------------------------------------------------------------------------------------
# layouts
def packed_desc(lens, total: int | None = None, device="cpu"):
    """fastdpo's packed-row descriptors (as PairBatch holds them): pair ids (-1 filler), segments, position ids."""
    pid, seg, pos = [], [], []
    for i, (p, c, r) in enumerate(lens):
        pid += [i] * (p + c + r)
        seg += [0] * p + [1] * c + [2] * r
        pos += list(range(p + c)) + list(range(p, p + r))
    f = (total or len(pid)) - len(pid)
    pid += [-1] * f
    seg += [0] * f
    pos += [0] * f
    return SimpleNamespace(pair_ids=torch.tensor(pid, dtype=torch.int32, device=device),
                           segments=torch.tensor(seg, dtype=torch.int8, device=device),
                           position_ids=torch.tensor([pos], dtype=torch.long, device=device))


@dataclass
class VarlenMeta:
    kidx: torch.Tensor  # (T + sum P,) long: packed row of each key, sequence after sequence
    cu_q: torch.Tensor  # (S+1,) int32
    cu_k: torch.Tensor  # (S+1,) int32
    max_q: int
    max_k: int

    def kwargs(self) -> dict:
        return {"fdpo_kidx": self.kidx, "fdpo_cu_q": self.cu_q, "fdpo_cu_k": self.cu_k,
                "fdpo_max_q": self.max_q, "fdpo_max_k": self.max_k}


def varlen_meta(lens, total: int | None = None, device="cpu", bound: int | None = None, leaky=False) -> VarlenMeta:
    """Two sequences per pair; a trailing filler run (up to `total`) is one more causal sequence over itself.
    `bound`: pass this constant as max_q/max_k instead of the true maxima (must be >= them).
    `leaky`: negative control, rejected queries over keys [prompt|chosen|rejected] (the rule broken)."""
    cu_q, cu_k, kidx = [0], [0], []
    mq = mk = 0
    off = 0
    for p, c, r in lens:
        pc = p + c
        kidx.extend(range(off, off + pc))
        kidx.extend(range(off, off + (pc if leaky else p)))
        kidx.extend(range(off + pc, off + pc + r))
        rk = (pc if leaky else p) + r
        cu_q += [cu_q[-1] + pc, cu_q[-1] + pc + r]
        cu_k += [cu_k[-1] + pc, cu_k[-1] + pc + rk]
        mq, mk = max(mq, pc, r), max(mk, pc, rk)
        off += pc + r
    if total and total > off:
        f = total - off
        kidx.extend(range(off, total))
        cu_q.append(cu_q[-1] + f)
        cu_k.append(cu_k[-1] + f)
        mq, mk = max(mq, f), max(mk, f)
    if bound is not None:
        assert bound >= max(mq, mk), (bound, mq, mk)
        mq = mk = bound
    pin = torch.device(device).type == "cuda"

    def t(x, dt):
        h = torch.tensor(x, dtype=dt)
        return (h.pin_memory() if pin else h).to(device, non_blocking=True)

    return VarlenMeta(t(kidx, torch.long), t(cu_q, torch.int32), t(cu_k, torch.int32), mq, mk)


# ----------------------------------------------------------------------------------------------------------------
# references
def dense_reference(q, k, v, lens, scale, window=None):
    """float32 attention under fastdpo's pair rule, one pair block at a time (T x T never formed). q (T,H,D),
    k/v (T,KV,D) in packed order; filler rows (past the pairs) come out zero."""
    h, kv = q.shape[1], k.shape[1]
    outs, off = [], 0
    for p, c, r in lens:
        n = p + c + r
        dev = q.device
        seg = torch.tensor([0] * p + [1] * c + [2] * r, device=dev)
        pos = torch.tensor(list(range(p + c)) + list(range(p, p + r)), device=dev)
        idx = torch.arange(n, device=dev)
        ok = (idx[None, :] <= idx[:, None]) & ((seg[None, :] == 0) | (seg[None, :] == seg[:, None]))
        if window is not None:
            ok &= (pos[:, None] - pos[None, :]) < window
        qq = q[off:off + n].transpose(0, 1)
        kk = k[off:off + n].repeat_interleave(h // kv, dim=1).transpose(0, 1)
        vv = v[off:off + n].repeat_interleave(h // kv, dim=1).transpose(0, 1)
        s = (qq @ kk.transpose(1, 2)) * scale
        s = s.masked_fill(~ok, float("-inf"))
        outs.append((s.softmax(-1) @ vv).transpose(0, 1))
        off += n
    if off < q.shape[0]:
        outs.append(q.new_zeros(q.shape[0] - off, h, v.shape[-1]))
    return torch.cat(outs)


def varlen_emulated(q, k, v, cu_q, cu_k, max_q, max_k, scale=None, window_size=(-1, -1)):
    """Pure-torch stand-in with varlen_attn's documented semantics (bottom-right aligned windows, GQA by head
    groups); float32 math. For CPU runs of the layout and for checking our reading of the semantics."""
    h, kv, d = q.shape[1], k.shape[1], q.shape[2]
    scale = d ** -0.5 if scale is None else scale
    wl, wr = window_size
    cq, ck = cu_q.tolist(), cu_k.tolist()
    outs = []
    for i in range(len(cq) - 1):
        a, b, c, e = cq[i], cq[i + 1], ck[i], ck[i + 1]
        sq, sk = b - a, e - c
        if sq == 0:
            continue
        assert sq <= max_q and sk <= max_k
        qi = q[a:b].float().transpose(0, 1)
        ki = k[c:e].float().repeat_interleave(h // kv, dim=1).transpose(0, 1)
        vi = v[c:e].float().repeat_interleave(h // kv, dim=1).transpose(0, 1)
        s = (qi @ ki.transpose(1, 2)) * scale
        ii = torch.arange(sq, device=q.device)[:, None] + (sk - sq)
        jj = torch.arange(sk, device=q.device)[None, :]
        ok = torch.ones(sq, sk, dtype=torch.bool, device=q.device)
        if wr >= 0:
            ok &= jj <= ii + wr
        if wl >= 0:
            ok &= jj >= ii - wl
        s = s.masked_fill(~ok, float("-inf"))
        outs.append((s.softmax(-1) @ vi).transpose(0, 1).to(q.dtype))
    return torch.cat(outs)


# ----------------------------------------------------------------------------------------------------------------
# the real varlen_attn, through whatever signature this torch has
@functools.cache
def varlen_api():
    from torch.nn.attention import varlen

    return varlen.varlen_attn, tuple(inspect.signature(varlen.varlen_attn).parameters), str(
        inspect.signature(varlen.varlen_attn))


_GQA: str | None = None  # enable_gqa | native | repeat


def window_size_of(window: int | None) -> tuple[int, int]:
    return (-1, 0) if window is None else (window - 1, 0)


_API: tuple | None = None  # (varlen_attn, its parameter names): resolved eagerly, outside any compiled region


def resolve_api():
    global _API
    if _API is None:
        fn, params, _ = varlen_api()
        _API = (fn, params)
    return _API


def call_varlen(q, k, v, cu_q, cu_k, max_q, max_k, scale, window, gqa: str | None = None):
    fn, params = _API if _API is not None else resolve_api()
    kw = {}
    if "scale" in params:
        kw["scale"] = scale
    else:
        assert scale is None or abs(scale - q.shape[-1] ** -0.5) < 1e-12, "this varlen_attn has no scale"
    if "window_size" in params:
        kw["window_size"] = window_size_of(window)
    else:
        assert window is None, "this varlen_attn has no window_size"
        kw["is_causal"] = True
    if q.shape[1] != k.shape[1]:
        mode = gqa or _GQA
        if mode == "enable_gqa":
            kw["enable_gqa"] = True
        elif mode == "repeat":
            g = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    return fn(q, k, v, cu_q, cu_k, max_q, max_k, **kw)


def setup_gqa(device) -> dict:
    """How this torch takes fewer kv heads: the `enable_gqa` flag, natively (no check), or by repeating them.
    Native is accepted only if its output and grads match the repeated path."""
    global _GQA
    _, params = resolve_api()
    info = {"has_enable_gqa": "enable_gqa" in params}
    if "enable_gqa" in params:
        _GQA = "enable_gqa"
    else:
        try:
            torch.manual_seed(1)
            lens = [(5, 7, 3), (0, 4, 9)]
            t = n_tokens(lens)
            q = torch.randn(t, 4, 64, device=device, dtype=torch.bfloat16, requires_grad=True)
            k = torch.randn(t, 2, 64, device=device, dtype=torch.bfloat16, requires_grad=True)
            v = torch.randn(t, 2, 64, device=device, dtype=torch.bfloat16, requires_grad=True)
            m = varlen_meta(lens, device=device)
            res = []
            for mode in ("native", "repeat"):
                o = call_varlen(q, k.index_select(0, m.kidx), v.index_select(0, m.kidx), m.cu_q, m.cu_k,
                                m.max_q, m.max_k, None, None, gqa=mode)
                res.append([o.float(), *[g.float() for g in torch.autograd.grad(o.float().sum(), (q, k, v))]])
            diff = max((a - b).abs().max().item() for a, b in zip(*res, strict=True))
            info["native_vs_repeat_maxdiff"] = diff
            _GQA = "native" if diff < 1e-2 else "repeat"
        except Exception as e:  # noqa: BLE001
            info["native_error"] = f"{type(e).__name__}: {str(e)[:300]}"
            _GQA = "repeat"
    info["gqa_mode"] = _GQA
    return info


def varlen_emulated_backward(grad_out, q, k, v, cu_q, cu_k, scale=None, window_size=(-1, -1)):
    """Analytic backward of `varlen_emulated` (float32 math): dq, dk, dv."""
    h, kv, d = q.shape[1], k.shape[1], q.shape[2]
    g = h // kv
    scale = d ** -0.5 if scale is None else scale
    wl, wr = window_size
    dq, dk, dv = torch.zeros_like(q, dtype=torch.float32), torch.zeros_like(k, dtype=torch.float32), \
        torch.zeros_like(v, dtype=torch.float32)
    cq, ck = cu_q.tolist(), cu_k.tolist()
    for i in range(len(cq) - 1):
        a, b, c, e = cq[i], cq[i + 1], ck[i], ck[i + 1]
        sq, sk = b - a, e - c
        if sq == 0:
            continue
        qi = q[a:b].float().transpose(0, 1)
        ki = k[c:e].float().repeat_interleave(g, dim=1).transpose(0, 1)
        vi = v[c:e].float().repeat_interleave(g, dim=1).transpose(0, 1)
        do = grad_out[a:b].float().transpose(0, 1)
        s = (qi @ ki.transpose(1, 2)) * scale
        ii = torch.arange(sq)[:, None] + (sk - sq)
        jj = torch.arange(sk)[None, :]
        ok = torch.ones(sq, sk, dtype=torch.bool)
        if wr >= 0:
            ok &= jj <= ii + wr
        if wl >= 0:
            ok &= jj >= ii - wl
        p = s.masked_fill(~ok, float("-inf")).softmax(-1)
        dvi = p.transpose(1, 2) @ do
        dp = do @ vi.transpose(1, 2)
        ds = p * (dp - (dp * p).sum(-1, keepdim=True)) * scale
        dq[a:b] = (ds @ ki).transpose(0, 1)
        dk[c:e] = (ds.transpose(1, 2) @ qi).transpose(0, 1).reshape(sk, kv, g, d).sum(2)
        dv[c:e] = dvi.transpose(0, 1).reshape(sk, kv, g, d).sum(2)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def register_cpu_kernels() -> bool:
    """CPU kernels for torch_attn::_varlen_attn and its backward (the emulation above), so that the real
    varlen_attn Python path, its custom op and torch.compile can be exercised on a CPU-only machine."""
    try:
        from torch.nn.attention import varlen as V
    except ImportError:
        return False

    def fwd(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, scale=None, window_size=None,
            *rest, **kw):
        ws = tuple(window_size) if window_size is not None else (-1, -1)
        if is_causal:
            ws = (ws[0], 0)
        with torch.enable_grad():
            out = varlen_emulated(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale, ws)
        lse = torch.zeros(query.shape[1], query.shape[0], dtype=torch.float32)
        return out.detach(), lse, torch.zeros(2, dtype=torch.uint64)

    def bwd(grad_out, query, key, value, out, lse, cu_seq_q, cu_seq_k, max_q, max_k, is_causal, rng_state,
            scale=None, window_size=None, *rest, **kw):
        ws = tuple(window_size) if window_size is not None else (-1, -1)
        if is_causal:
            ws = (ws[0], 0)
        return varlen_emulated_backward(grad_out, query, key, value, cu_seq_q, cu_seq_k, scale, ws)

    V._varlen_attn.register_kernel("cpu")(fwd)
    V._varlen_attn_backward.register_kernel("cpu")(bwd)
    return True


def pair_attention(q, k, v, kidx, cu_q, cu_k, max_q, max_k, scale=None, window=None, impl="varlen"):
    """The per-layer call. q (T,H,D), k/v (T,KV,D) packed -> (T,H,D) packed."""
    kk, vv = k.index_select(0, kidx), v.index_select(0, kidx)
    if impl == "varlen":
        return call_varlen(q, kk, vv, cu_q, cu_k, max_q, max_k, scale, window)
    return varlen_emulated(q, kk, vv, cu_q, cu_k, max_q, max_k, scale, window_size_of(window))


IMPL = "varlen"


def hf_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, sliding_window=None, **kw):
    """transformers attention function: query (1,H,T,D), key/value (1,KV,T,D) -> ((1,T,H,D), None)."""
    q, k, v = query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1)
    out = pair_attention(q, k, v, kw["fdpo_kidx"], kw["fdpo_cu_q"], kw["fdpo_cu_k"], kw["fdpo_max_q"],
                         kw["fdpo_max_k"], scaling, sliding_window, IMPL)
    return out.unsqueeze(0), None


def register_hf(name="fastdpo_varlen"):
    from transformers import AttentionInterface

    AttentionInterface.register(name, hf_attention)
    try:
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

        ALL_MASK_ATTENTION_FUNCTIONS.register(name, lambda *a, **k: None)
    except ImportError:
        pass
    return name


# ----------------------------------------------------------------------------------------------------------------
# fastdpo's flex path
def flex_parts():
    """fastdpo's flex_block_mask and compiled flex_attention (module path moves during the src reorganisation)."""
    errs = []
    for name in ("fastdpo.attention", "fastdpo.model.attention"):
        try:
            m = importlib.import_module(name)
            fbm = m.flex_block_mask
        except Exception as e:  # noqa: BLE001
            errs.append(f"{name}: {type(e).__name__}: {str(e)[:160]}")
            continue
        comp = getattr(m, "_compiled_flex", None)
        return fbm, (comp() if comp else None), name, errs
    return flex_block_mask_copy, None, "embedded copy of fastdpo's flex_block_mask (both imports failed)", errs


def flex_block_mask_copy(batch, window=None, b=128):
    """Fallback only: the same construction as fastdpo's flex_block_mask (rule evaluated per 128x128 tile, full and
    partial blocks listed apart, stable descending order), for when the src tree is mid-move."""
    from torch.nn.attention.flex_attention import BlockMask

    pid, seg, pos = batch.pair_ids, batch.segments, batch.position_ids[0]
    t = pid.numel()
    n = t // b
    idx = torch.arange(t, device=pid.device)

    def rule(qi, ki):
        ok = (pid[qi] == pid[ki]) & (ki <= qi) & ((seg[ki] == 0) | (seg[ki] == seg[qi]))
        return ok if window is None else ok & (pos[qi] - pos[ki] < window)

    with torch.no_grad():
        cnt = rule(idx[:, None], idx[None, :]).view(n, b, n, b).sum(dim=(1, 3))
    full, partial = cnt == b * b, (cnt > 0) & (cnt < b * b)

    def ordered(blocks):
        num = blocks.sum(dim=-1, dtype=torch.int32)
        ind = torch.argsort(blocks.to(torch.int32), dim=-1, descending=True, stable=True).to(torch.int32)
        return num[None, None].contiguous(), ind[None, None].contiguous()

    kv_num, kv_idx = ordered(partial)
    f_num, f_idx = ordered(full)
    return BlockMask.from_kv_blocks(kv_num, kv_idx, f_num, f_idx, BLOCK_SIZE=b,
                                    mask_mod=lambda b_, h, q_, k: rule(q_, k))


def compiled_flex_fallback():
    import torch._dynamo
    from torch.nn.attention.flex_attention import flex_attention

    for n in ("recompile_limit", "cache_size_limit"):
        if hasattr(torch._dynamo.config, n):
            setattr(torch._dynamo.config, n, max(getattr(torch._dynamo.config, n), 256))
    return torch.compile(flex_attention, dynamic=False)


# ----------------------------------------------------------------------------------------------------------------
def err(a, b) -> dict:
    a, b = a.float(), b.float()
    return {"max_abs": (a - b).abs().max().item(), "rel_l2": ((a - b).norm() / b.norm().clamp_min(1e-30)).item(),
            "ref_max": b.abs().max().item(), "finite": bool(torch.isfinite(a).all())}


def rand_qkv(t, h, kv, d, device, dtype, seed):
    g = torch.Generator(device=device).manual_seed(seed)
    mk = lambda n: torch.randn(t, n, d, device=device, dtype=dtype, generator=g).requires_grad_(True)  # noqa: E731
    return mk(h), mk(kv), mk(kv), torch.randn(t, h, d, device=device, dtype=dtype, generator=g)


def part_info(dev):
    import torch.nn.attention as A

    _, params, sig = varlen_api()
    from torch.nn.attention import varlen

    src = inspect.getsource(varlen)
    rec = {"torch": torch.__version__, "cuda": torch.version.cuda, "signature": sig,
           "device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
           "custom_op_registered": hasattr(torch.ops.torch_attn, "_varlen_attn"),
           "has_register_fake": "register_fake" in src, "has_register_autograd": "register_autograd" in src,
           "src_mentions": {w: (w in src) for w in ("enable_gqa", "window_size", "is_causal", "cudnn", "seqused_k",
                                                     "block_table", "num_splits", "k_cache", "varlen_attn_out")},
           "attention_module_names": sorted(n for n in dir(A) if not n.startswith("_"))}
    for fn in ("list_flash_attention_impls", "current_flash_attention_impl"):
        if hasattr(A, fn):
            try:
                rec[fn] = getattr(A, fn)()
            except Exception as e:  # noqa: BLE001
                rec[fn] = f"{type(e).__name__}: {e}"
    try:
        with open(os.path.join(OUT, "torch_varlen_src.py"), "w") as f:
            f.write(src)
    except OSError:
        pass
    if dev.type == "cuda":
        rec.update(setup_gqa(dev))
    emit(rec)


EXACT_CASES = [
    # (name, lens, window)
    ("edge", [(0, 5, 7), (1, 1, 1), (13, 1, 9), (0, 1, 1), (7, 12, 1), (64, 64, 64), (3, 200, 150)], None),
    ("anchor_like", None, None),
    ("window64", None, 64),
    ("window1", [(0, 5, 7), (1, 1, 1), (13, 1, 9), (40, 30, 20)], 1),
    ("long_window512", [(900, 700, 420), (100, 1500, 300)], 512),
]


def part_exact(dev, impl):
    h, kv, d = 16, 8, 128
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    rng = random.Random(7)
    for ci, (name, lens, window) in enumerate(EXACT_CASES):
        lens = lens or (sample_lengths(rng, 3) + [(0, 3, 2), (1, 1, 1)])
        t = n_tokens(lens)
        for pad in (0, 37):  # a filler run after the pairs as fastdpo's bucket padding would add
            q, k, v, go = rand_qkv(t + pad, h, kv, d, dev, dtype, seed=100 + ci * 2 + (pad > 0))
            scale = d ** -0.5
            m = varlen_meta(lens, total=t + pad, device=dev)
            # filler rows are outside the comparison (zero output gradient there); their queries must not leak
            # into real tokens' outputs or grads
            real = (torch.arange(t + pad, device=dev) < t)[:, None, None]
            go = go * real
            o = pair_attention(q, k, v, m.kidx, m.cu_q, m.cu_k, m.max_q, m.max_k, scale, window, impl)
            grads = torch.autograd.grad(o, (q, k, v), go)
            qf, kf, vf = (x.detach().float().requires_grad_(True) for x in (q, k, v))
            ref = dense_reference(qf, kf, vf, lens, scale, window)
            rgrads = torch.autograd.grad(ref, (qf, kf, vf), go.float())
            rec = {"case": name, "impl": impl, "dtype": str(dtype), "heads": [h, kv], "window": window,
                   "pairs": len(lens), "tokens": t, "filler": pad, "min_seg": min(min(x) for x in lens),
                   "out": err(o[:t], ref[:t]), "dq": err(grads[0][:t], rgrads[0][:t]),
                   "dk": err(grads[1][:t], rgrads[1][:t]), "dv": err(grads[2][:t], rgrads[2][:t]),
                   "bf16_floor_out": (ref[:t].to(dtype).float() - ref[:t]).abs().max().item()}
            emit(rec)
    # negative control: the same check must fail when rejected sees chosen
    lens = EXACT_CASES[0][1]
    t = n_tokens(lens)
    q, k, v, go = rand_qkv(t, h, kv, d, dev, dtype, seed=77)
    m = varlen_meta(lens, device=dev, leaky=True)
    o = pair_attention(q, k, v, m.kidx, m.cu_q, m.cu_k, m.max_q, m.max_k, d ** -0.5, None, impl)
    ref = dense_reference(q.detach().float(), k.detach().float(), v.detach().float(), lens, d ** -0.5)
    emit({"case": "negative_control_rejected_sees_chosen", "impl": impl, "out": err(o, ref)})
    if dev.type == "cuda":
        # one flex yardstick on the same edge inputs (fastdpo's BlockMask + compiled flex), and a bounded max
        fbm, cflex, where, errs = flex_parts()
        lens = EXACT_CASES[0][1]
        t = n_tokens(lens)
        tp = -(-t // 128) * 128
        q, k, v, go = rand_qkv(tp, h, kv, d, dev, dtype, seed=5)
        if fbm is not None:
            cflex = cflex or compiled_flex_fallback()
            bm = fbm(packed_desc(lens, tp, dev), None)
            o = cflex(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], block_mask=bm,
                      scale=d ** -0.5, enable_gqa=True)[0].transpose(0, 1)
            mask = (torch.arange(tp, device=dev) < t)[:, None, None]
            grads = torch.autograd.grad(o, (q, k, v), go * mask)
            qf, kf, vf = (x.detach().float().requires_grad_(True) for x in (q, k, v))
            ref = dense_reference(qf, kf, vf, lens, d ** -0.5)
            rgrads = torch.autograd.grad(ref, (qf, kf, vf), (go * mask).float())
            emit({"case": "edge", "impl": "flex", "flex_from": where, "out": err(o[:t], ref[:t]),
                  "dq": err(grads[0][:t], rgrads[0][:t]), "dk": err(grads[1][:t], rgrads[1][:t]),
                  "dv": err(grads[2][:t], rgrads[2][:t])})
        else:
            emit({"case": "edge", "impl": "flex", "skipped": errs})
        m = varlen_meta(lens, device=dev)
        mb = varlen_meta(lens, device=dev, bound=2048)
        q, k, v, go = rand_qkv(t, h, kv, d, dev, dtype, seed=9)
        a = pair_attention(q, k, v, m.kidx, m.cu_q, m.cu_k, m.max_q, m.max_k, d ** -0.5)
        b = pair_attention(q, k, v, mb.kidx, mb.cu_q, mb.cu_k, mb.max_q, mb.max_k, d ** -0.5)
        ga = torch.autograd.grad(a, (q, k, v), go)
        gb = torch.autograd.grad(b, (q, k, v), go)
        emit({"case": "bound_2048_vs_true_max", "out_maxdiff": (a - b).abs().max().item(),
              "grad_maxdiff": max((x - y).abs().max().item() for x, y in zip(ga, gb, strict=True)),
              "true_max": [m.max_q, m.max_k]})


def bench_ms(fn, n=20) -> float:
    try:
        import triton.testing

        return triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median")
    except Exception:  # noqa: BLE001
        ts = []
        for _ in range(n):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            fn()
            e.record()
            e.synchronize()
            ts.append(s.elapsed_time(e))
        return statistics.median(ts)


LENGTH_TARGETS = [4096, 2900, 6100, 3500, 8192, 5000]


def part_lengths(dev, which):
    h, kv, d = 16, 8, 128
    scale = d ** -0.5
    rng = random.Random(11)
    batches = [pairs_for_tokens(rng, tgt) for tgt in LENGTH_TARGETS]
    fbm = cflex = None
    if "flex" in which:
        fbm, cflex, where, errs = flex_parts()
        if fbm is None:
            emit({"flex_import": errs})
        else:
            cflex = cflex or compiled_flex_fallback()
            emit({"flex_from": where, "import_errors": errs})
    for impl in which:
        if impl == "flex" and fbm is None:
            continue
        for bi, lens in enumerate(batches):
            t = n_tokens(lens)
            tp = -(-t // 128) * 128 if impl == "flex" else t
            q, k, v, go = rand_qkv(tp, h, kv, d, dev, torch.bfloat16, seed=1000 + bi)
            mask = (torch.arange(tp, device=dev) < t)[:, None, None]
            go = go * mask
            sync()
            t0 = time.perf_counter()
            if impl == "varlen":
                m = varlen_meta(lens, total=tp, device=dev)

                def run():
                    return pair_attention(q, k, v, m.kidx, m.cu_q, m.cu_k, m.max_q, m.max_k, scale)
            else:
                bm = fbm(packed_desc(lens, tp, dev), None)

                def run():
                    return cflex(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                 block_mask=bm, scale=scale, enable_gqa=True)[0].transpose(0, 1)
            sync()
            t_meta = time.perf_counter() - t0
            t0 = time.perf_counter()
            o = run()
            grads = torch.autograd.grad(o, (q, k, v), go)
            sync()
            first = time.perf_counter() - t0
            # exactness at this size
            qf, kf, vf = (x.detach().float().requires_grad_(True) for x in (q, k, v))
            ref = dense_reference(qf, kf, vf, lens, scale)
            rg = torch.autograd.grad(ref, (qf, kf, vf), go.float())
            e = {"out": err(o[:t], ref[:t])["rel_l2"], "dq": err(grads[0][:t], rg[0][:t])["rel_l2"],
                 "dk": err(grads[1][:t], rg[1][:t])["rel_l2"], "dv": err(grads[2][:t], rg[2][:t])["rel_l2"]}
            del qf, kf, vf, ref, rg

            def fb():
                torch.autograd.grad(run(), (q, k, v), go)

            def fwd():
                with torch.no_grad():
                    run()
            ms = bench_ms(fb)
            ms_f = bench_ms(fwd)
            flops = 4 * d * h * allowed_count(lens)
            emit({"impl": impl, "order": bi, "tokens": t, "computed_tokens": tp, "pairs": len(lens),
                  "meta_build_s": round(t_meta, 5), "first_fwd_bwd_s": round(first, 4), "steady_fwd_bwd_ms": round(ms, 3),
                  "steady_fwd_ms": round(ms_f, 3), "fwd_tflops": round(flops / ms_f / 1e9, 1),
                  "fwd_bwd_tflops": round(3.5 * flops / ms / 1e9, 1), "rel_l2_vs_fp32": e})
    if "flex" in which and fbm is not None:
        try:
            from torch._dynamo.utils import counters

            emit({"dynamo_counters": {k: dict(v) for k, v in counters.items() if k in ("stats", "recompiles")}})
        except Exception:  # noqa: BLE001
            pass


# ----------------------------------------------------------------------------------------------------------------
def qwen3_config(tiny=False, layers=28):
    from transformers import Qwen3Config

    if tiny:
        return Qwen3Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096)
    return Qwen3Config(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=layers,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                       rms_norm_eps=1e-6, rope_theta=1000000, tie_word_embeddings=True)


def dynamo_stats() -> dict:
    try:
        from torch._dynamo.utils import counters

        return {"unique_graphs": counters["stats"].get("unique_graphs", 0),
                "calls_captured": counters["stats"].get("calls_captured", 0),
                "graph_breaks": sum(counters["graph_break"].values()),
                "recompiles": dict(counters.get("recompiles", {}))}
    except Exception as e:  # noqa: BLE001
        return {"error": str(e)}


def part_layer(dev, tiny, only=""):
    import torch._dynamo as dynamo
    from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer, Qwen3RotaryEmbedding

    cfg = qwen3_config(tiny)
    cfg._attn_implementation = register_hf()
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    with torch.device(dev):
        rot = Qwen3RotaryEmbedding(cfg)
        layers = {}
        for name in ("eager", "compiled"):
            torch.manual_seed(0)
            layers[name] = Qwen3DecoderLayer(cfg, 0).to(dtype)
    rng = random.Random(3)
    lens_list = [pairs_for_tokens(rng, tgt) for tgt in LENGTH_TARGETS]
    hsz = cfg.hidden_size

    def inputs(lens, bound=None):
        t = n_tokens(lens)
        desc = packed_desc(lens, device=dev)
        x = torch.randn(1, t, hsz, device=dev, dtype=dtype, requires_grad=True)
        pe = rot(x, desc.position_ids)
        m = varlen_meta(lens, device=dev, bound=bound)
        return x, pe, desc.position_ids, m

    def step(layer, lens, bound=None):
        x, pe, pos, m = inputs(lens, bound)
        y = layer(x, attention_mask=None, position_ids=pos, position_embeddings=pe, **m.kwargs())
        y.float().square().mean().backward()
        return y

    def run_mode(mode, dyn, bound, n_len):
        dynamo.reset()
        dynamo.utils.counters.clear()
        layer = layers["compiled"]
        layer.compile(dynamic=dyn)
        per = []
        for lens in lens_list[:n_len]:
            sync()
            t0 = time.perf_counter()
            step(layer, lens, bound)
            sync()
            per.append({"tokens": n_tokens(lens), "first_call_s": round(time.perf_counter() - t0, 3),
                        "graphs_so_far": dynamo_stats()["unique_graphs"]})
        # the same lengths again: no compile expected
        sync()
        t0 = time.perf_counter()
        for lens in lens_list[:n_len]:
            step(layer, lens, bound)
        sync()
        again = (time.perf_counter() - t0) / n_len
        emit({"mode": mode, "dynamic": dyn, "bound": bound, "per_length": per, "repeat_mean_s": round(again, 4),
              "dynamo": dynamo_stats()})
        return layer

    # eager first (no compile at all), as the yardstick for the compiled layer's first calls
    per = []
    for lens in lens_list[: 1 if only else None]:
        sync()
        t0 = time.perf_counter()
        step(layers["eager"], lens)
        sync()
        per.append({"tokens": n_tokens(lens), "first_call_s": round(time.perf_counter() - t0, 4)})
    emit({"mode": "eager", "per_length": per})
    modes = [("dynamic_true_max", True, None, 6), ("dynamic_bound", True, 2048, 6),
             ("auto_dynamic", None, None, 3), ("static", False, None, 2)]
    if tiny:
        modes = modes[:1]
    if only:
        modes = [m for m in modes if m[0] in only.split(",")]
    for mode, dyn, bound, n_len in modes:
        try:
            layer = run_mode(mode, dyn, bound, n_len)
        except Exception as e:  # noqa: BLE001
            emit({"mode": mode, "error": f"{type(e).__name__}: {str(e)[:600]}"})
            continue
        if mode == "dynamic_true_max" and dev.type == "cuda":
            x, pe, pos, m = inputs(lens_list[0])
            res = {}
            for name in ("eager", "compiled"):
                lay = layers[name]

                def fb():
                    y = lay(x, attention_mask=None, position_ids=pos, position_embeddings=pe, **m.kwargs())
                    torch.autograd.grad(y.float().square().mean(), [x] + list(lay.parameters()))
                res[name + "_fwd_bwd_ms"] = round(bench_ms(fb), 3)
            # same weights in both layers (seed 0): outputs must agree to bf16 noise
            with torch.no_grad():
                ye = layers["eager"](x, attention_mask=None, position_ids=pos, position_embeddings=pe, **m.kwargs())
                yc = layer(x, attention_mask=None, position_ids=pos, position_embeddings=pe, **m.kwargs())
            emit({"mode": "steady_one_layer", "tokens": n_tokens(lens_list[0]), **res,
                  "compiled_vs_eager": err(yc, ye)})


# ----------------------------------------------------------------------------------------------------------------
def micro_batches(lens, budget):
    out, cur = [], []
    for pr in sorted(lens, key=lambda x: -sum(x)):
        if cur and n_tokens(cur) + sum(pr) > budget:
            out.append(cur)
            cur = []
        cur.append(pr)
    return out + ([cur] if cur else [])


def part_stack(dev, compile_mode, tiny, steps, pairs_per_step, budget, route, bound):
    global IMPL
    from transformers import Qwen3ForCausalLM

    if dev.type != "cuda":
        IMPL = "emulated"
    t_start = time.perf_counter()
    cfg = qwen3_config(tiny)
    cfg._attn_implementation = register_hf()
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    torch.manual_seed(0)
    with torch.device(dev):
        model = Qwen3ForCausalLM(cfg)
    model.to(dtype)
    model.config._attn_implementation = cfg._attn_implementation
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=dev.type == "cuda")
    if compile_mode == "dynamic":
        import torch._dynamo as dynamo

        dynamo.config.optimize_ddp = False
        for layer in model.model.layers:
            layer.compile(dynamic=True)
    sync()
    t_ready = time.perf_counter()
    rng = random.Random(21)
    step_lens = [sample_lengths(rng, pairs_per_step) for _ in range(steps)]
    w = model.lm_head.weight
    used_route = [route]

    def forward_hidden(ids, pos, m):
        if used_route[0] == "model":
            try:
                return model.model(input_ids=ids, position_ids=pos, attention_mask={"full_attention": None},
                                   use_cache=False, **m.kwargs()).last_hidden_state
            except Exception as e:  # noqa: BLE001
                emit({"route_model_failed": f"{type(e).__name__}: {str(e)[:400]}"})
                used_route[0] = "layers"
        hdn = model.model.embed_tokens(ids)
        pe = model.model.rotary_emb(hdn, pos)
        for layer in model.model.layers:
            hdn = layer(hdn, attention_mask=None, position_ids=pos, position_embeddings=pe, **m.kwargs())
        return model.model.norm(hdn)

    def one_step(lens):
        mbs = micro_batches(lens, budget)
        for mb in mbs:
            t = n_tokens(mb)
            desc = packed_desc(mb, device=dev)
            m = varlen_meta(mb, device=dev, bound=bound)
            ids = torch.randint(4, cfg.vocab_size, (1, t), device=dev)
            comp = (desc.segments > 0).nonzero().squeeze(1)
            tgt = torch.randint(4, cfg.vocab_size, (comp.numel(),), device=dev)
            hdn = forward_hidden(ids, desc.position_ids, m)[0].index_select(0, comp)
            logits = (hdn @ w.t()).float()
            loss = (logits.logsumexp(-1) - logits.gather(1, tgt[:, None]).squeeze(1)).mean() / len(mbs)
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return [n_tokens(mb) for mb in mbs]

    recs = []
    for rnd in ("new_lengths", "seen_lengths"):
        for i, lens in enumerate(step_lens):
            sync()
            t0 = time.perf_counter()
            mbt = one_step(lens)
            sync()
            dt = time.perf_counter() - t0
            recs.append({"round": rnd, "step": i, "micro_batch_tokens": mbt, "step_s": round(dt, 3)})
            print(f"  {compile_mode} {rnd} step {i}: {mbt} tokens, {dt:.3f} s", flush=True)
    new = [r["step_s"] for r in recs if r["round"] == "new_lengths"]
    seen = [r["step_s"] for r in recs if r["round"] == "seen_lengths"]
    toks = sum(sum(r["micro_batch_tokens"]) for r in recs if r["round"] == "seen_lengths")
    emit({"compile": compile_mode, "bound": bound, "route": used_route[0], "tiny": tiny, "layers": cfg.num_hidden_layers,
          "build_to_ready_s": round(t_ready - t_start, 2), "time_to_first_step_s": new[0],
          "new_length_steps_s": new, "seen_length_steps_s": seen,
          "steady_pairs_per_s": round(pairs_per_step * len(seen) / sum(seen), 2),
          "steady_tokens_per_s": round(toks / sum(seen)),
          "distinct_micro_batch_lengths": len({x for r in recs for x in r["micro_batch_tokens"]}),
          "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if dev.type == "cuda" else None,
          "dynamo": dynamo_stats() if compile_mode != "none" else None, "steps": recs})


# ----------------------------------------------------------------------------------------------------------------
def main():
    global PART, IMPL
    ap = argparse.ArgumentParser()
    ap.add_argument("--part", required=True, choices=["info", "exact", "lengths", "layer", "stack"])
    ap.add_argument("--device", default="auto")
    ap.add_argument("--impl", default="auto", choices=["auto", "varlen", "emulated"])
    ap.add_argument("--which", default="varlen,flex", help="lengths: implementations in order")
    ap.add_argument("--compile", default="none", choices=["none", "dynamic"])
    ap.add_argument("--tiny", action="store_true", help="tiny Qwen3 config (CPU smoke runs)")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--pairs_per_step", type=int, default=8)
    ap.add_argument("--budget", type=int, default=4096)
    ap.add_argument("--route", default="model", choices=["model", "layers"])
    ap.add_argument("--bound", type=int, default=None, help="stack: constant max_q/max_k (>= the longest pair)")
    ap.add_argument("--no_mix_order", action="store_true",
                    help="inductor: triton.mix_order_reduction off (its size checks guard on ranges of T and cost a "
                         "compiled graph per range)")
    ap.add_argument("--modes", default="", help="layer: comma-separated subset of the compile modes")
    a = ap.parse_args()
    PART = a.part
    dev = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if a.device == "auto" else a.device)
    IMPL = a.impl if a.impl != "auto" else ("varlen" if dev.type == "cuda" else "emulated")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    os.makedirs(OUT, exist_ok=True)
    if dev.type == "cuda" and a.part != "info":
        setup_gqa(dev)
    if a.part in ("layer", "stack") and dev.type == "cuda":
        torch._logging.set_logs(recompiles=True, graph_breaks=True)
    if a.no_mix_order:
        import torch._inductor.config as ic

        try:
            ic.triton.mix_order_reduction = False
        except AttributeError as e:
            emit({"no_mix_order_unavailable": str(e)})
    emit({"config": {"no_mix_order": a.no_mix_order, "compile": a.compile, "bound": a.bound, "modes": a.modes}})
    t0 = time.perf_counter()
    try:
        if a.part == "info":
            part_info(dev)
        elif a.part == "exact":
            part_exact(dev, IMPL)
        elif a.part == "lengths":
            part_lengths(dev, a.which.split(","))
        elif a.part == "layer":
            part_layer(dev, a.tiny, a.modes)
        else:
            part_stack(dev, a.compile, a.tiny, a.steps, a.pairs_per_step, a.budget, a.route, a.bound)
    except Exception as e:
        import traceback

        traceback.print_exc()
        emit({"error": f"{type(e).__name__}: {str(e)[:800]}"})
        raise
    finally:
        print(f"part {a.part} done in {time.perf_counter() - t0:.1f} s", flush=True)


if __name__ == "__main__":
    sys.exit(main())
