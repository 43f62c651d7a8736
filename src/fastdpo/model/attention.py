"""Attention for the packed, prefix-shared pair layout (DESIGN §1, §3).

Rule for query q and key k: same pair, k <= q in packed order, and k is a prompt token or in q's own segment
(rejected never sees chosen). An optional sliding window is folded in through the position ids.

Backends:
- `varlen` (CUDA, bf16/fp16; the default there): FlashAttention's variable-length kernel, whose separate query and
  key offsets express the rule exactly: each pair is two causal sequences, queries `[prompt | chosen]` over keys
  `[prompt | chosen]`, and queries `rejected` over keys `[prompt | rejected]` with the causal mask aligned to the
  end. Its kernels do not depend on the sequence length, so nothing is built per micro-batch length.
- `flex` (CUDA): a FlexAttention BlockMask, built once per micro-batch and shared by all layers; its kernels are
  compiled per static length (fp32 models, or a torch without varlen).
- `dense` (boolean mask through SDPA): CPU and tests.
`flex` and `dense` plug into transformers models as the attention function "fastdpo", with the mask passed as a
ready 4-D `attention_mask` that transformers forwards untouched; `varlen` as "fastdpo_varlen", with its sequence
offsets passed as keyword arguments that transformers hands to the attention function.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from fastdpo.data.pack import PROMPT, PairBatch, int_tensor
from fastdpo.kernels.gather_rows import gather_rows
from fastdpo.kernels.launch import available as kernels_available

ATTN_NAME = "fastdpo"
VARLEN_NAME = "fastdpo_varlen"
FLEX_BLOCK = 128


def allowed(q_pair, k_pair, q_seg, k_seg, q_idx, k_idx, q_pos, k_pos, window: int | None):
    """The attention rule, written once, elementwise on broadcastable tensors."""
    ok = (q_pair == k_pair) & (k_idx <= q_idx) & ((k_seg == PROMPT) | (k_seg == q_seg))
    if window is not None:
        ok = ok & (q_pos - k_pos < window)
    return ok


def sliding_window(config) -> tuple[bool, int | None, str]:
    """(supported by the packed path, uniform window or None, reason if not supported)."""
    if getattr(config, "attn_logit_softcapping", None):
        return False, None, "attention logit soft-capping"
    types = getattr(config, "layer_types", None)
    window = getattr(config, "sliding_window", None)
    if types:
        kinds = set(types)
        if kinds == {"full_attention"}:
            return True, None, ""
        if kinds == {"sliding_attention"} and window:
            return True, int(window), ""
        return False, None, f"mixed attention layer types {sorted(kinds)}"
    if window and getattr(config, "use_sliding_window", True):
        return True, int(window), ""
    return True, None, ""


def dense_mask(batch: PairBatch, window: int | None = None) -> torch.Tensor:
    """(1, 1, T, T) boolean mask, True where attention is allowed. O(T^2) memory: small inputs only."""
    pid, seg = batch.pair_ids, batch.segments
    pos = batch.position_ids[0]
    idx = torch.arange(pid.numel(), device=pid.device)
    m = allowed(pid[:, None], pid[None, :], seg[:, None], seg[None, :], idx[:, None], idx[None, :],
                pos[:, None], pos[None, :], window)
    return m[None, None]


MASK_CHUNK = 1 << 25  # query-block rows of the rule evaluated at once: at most ~32M elements


def flex_block_mask(batch: PairBatch, window: int | None = None):
    """A FlexAttention BlockMask for the micro-batch; T must be a multiple of FLEX_BLOCK.

    Built in plain tensor ops, not through a compiled `create_block_mask`, whose first compilation can take minutes
    at some lengths (Triton's sort codegen): the rule is evaluated a chunk of query blocks at a time, each 128 x 128
    tile classified as full (every entry allowed), partial, or empty, and the block lists ordered the way
    `create_block_mask` orders them (full blocks apart, then a stable descending sort)."""
    from torch.nn.attention.flex_attention import BlockMask

    pid, seg, pos = batch.pair_ids, batch.segments, batch.position_ids[0]
    t, b = pid.numel(), FLEX_BLOCK
    n = t // b
    idx = torch.arange(t, device=pid.device)
    step = max(1, MASK_CHUNK // (b * t))
    partial, full = [], []
    with torch.no_grad():
        for start in range(0, n, step):
            q = idx[start * b : min(n, start + step) * b]
            m = allowed(pid[q, None], pid[None, :], seg[q, None], seg[None, :], q[:, None], idx[None, :],
                        pos[q, None], pos[None, :], window).view(-1, b, n, b)
            count = m.sum(dim=(1, 3))
            full.append(count == b * b)
            partial.append((count > 0) & (count < b * b))

    def ordered(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        num = blocks.sum(dim=-1, dtype=torch.int32)
        indices = torch.argsort(blocks.to(torch.int32), dim=-1, descending=True, stable=True).to(torch.int32)
        return num[None, None].contiguous(), indices[None, None].contiguous()

    def mask_mod(b_, h, q_, k):
        return allowed(pid[q_], pid[k], seg[q_], seg[k], q_, k, pos[q_], pos[k], window)

    kv_num, kv_idx = ordered(torch.cat(partial))
    full_num, full_idx = ordered(torch.cat(full))
    # T is a multiple of the block: the default sequence lengths (blocks x 128) are exactly (T, T)
    return BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=b, mask_mod=mask_mod)


# Dynamo's default limit is 8 graphs per function; past it, it runs the function uncompiled, and uncompiled flex
# attention materializes the whole score matrix (slow, and out of memory on long micro-batches). A budget gives a few
# static lengths (with and without grad); without a budget each 128-token length is its own graph.
FLEX_RECOMPILES = 256


def allow_recompiles(n: int) -> None:
    """Let TorchDynamo keep at least `n` compiled graphs per function (never lowers a larger setting)."""
    import torch._dynamo

    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, max(getattr(torch._dynamo.config, name), n))


@functools.cache
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    allow_recompiles(FLEX_RECOMPILES)
    return torch.compile(flex_attention, dynamic=False)


def check_window(kwargs: dict, window: int | None) -> None:
    """The layer's sliding window (transformers' `sliding_window` keyword) is the one the mask was built with."""
    sw = kwargs.get("sliding_window")
    assert sw is None or sw == window, f"layer asks for sliding window {sw}, mask was built with {window}"


def fastdpo_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers attention function. query (B, H, T, D), key/value (B, Hkv, T, D) -> ((B, T, H, D), None)."""
    check_window(kwargs, getattr(module, "_fastdpo_window", None))
    if attention_mask is None:
        raise RuntimeError("fastdpo attention needs the packed-layout mask; call through fastdpo.model.load.forward_hidden")
    gqa = query.shape[1] != key.shape[1]
    if isinstance(attention_mask, torch.Tensor):
        out = F.scaled_dot_product_attention(
            query, key, value, attn_mask=attention_mask, scale=scaling,
            dropout_p=dropout if module.training else 0.0, enable_gqa=gqa,
        )
    else:
        out = _compiled_flex()(query, key, value, block_mask=attention_mask, scale=scaling, enable_gqa=gqa)
    return out.transpose(1, 2).contiguous(), None


# ---------------------------------------------------------------- varlen


@dataclass
class VarlenMask:
    """Sequence offsets of one micro-batch, shared by all layers. Queries are the packed tokens in packed order;
    `key_index` (K,) long names the packed token of each key, sequence after sequence (a prompt's keys appear in
    both of its pair's sequences). cu_q / cu_k (S+1,) int32 are the sequences' offsets into queries and keys.
    `key_first` / `key_second` (T,) long: where each packed token's key sits in `key_index`, first and second place
    (-1: a key once only), for the gathered keys' backward (`key_sources`)."""

    key_index: torch.Tensor
    cu_q: torch.Tensor
    cu_k: torch.Tensor
    max_q: int
    max_k: int
    key_first: torch.Tensor | None = None
    key_second: torch.Tensor | None = None
    attn_name = VARLEN_NAME  # the attention function `target_hidden` switches the model to (a class attribute)

    def kwargs(self) -> dict:
        """What the decoder forward passes on to every layer's attention function."""
        return {"fastdpo_key_index": self.key_index, "fastdpo_cu_q": self.cu_q, "fastdpo_cu_k": self.cu_k,
                "fastdpo_max_q": self.max_q, "fastdpo_max_k": self.max_k, "fastdpo_key_first": self.key_first,
                "fastdpo_key_second": self.key_second}


def varlen_layout(pair_lengths, total: int) -> tuple[list[int], list[int], list[int], int, int]:
    """(key_index, cu_q, cu_k, max_q, max_k) for runs laid out as [prompt | y1 | ... | yK] (a pair: [prompt | chosen |
    rejected]), in order, in a row of `total` tokens: prompt + y1 is one causal sequence, each later yk a sequence
    of its own queries over [prompt keys | its own keys]; trailing filler is one more causal sequence over itself.
    Host lists, no device work."""
    key_index: list[int] = []
    cu_q, cu_k = [0], [0]
    max_q = max_k = 0
    off = 0

    def add(n_q: int, keys: list[int]) -> None:
        nonlocal max_q, max_k
        if n_q == 0:
            return
        key_index.extend(keys)
        cu_q.append(cu_q[-1] + n_q)
        cu_k.append(cu_k[-1] + len(keys))
        max_q, max_k = max(max_q, n_q), max(max_k, len(keys))

    for n_p, *completions in pair_lengths:
        n_1 = completions[0] if completions else 0
        add(n_p + n_1, list(range(off, off + n_p + n_1)))
        at = off + n_p + n_1
        for n_k in completions[1:]:
            add(n_k, list(range(off, off + n_p)) + list(range(at, at + n_k)))
            at += n_k
        off = at
    assert off <= total, (off, total)
    add(total - off, list(range(off, total)))
    return key_index, cu_q, cu_k, max_q, max_k


def key_sources(pair_lengths, total: int) -> tuple[list[int], list[int]] | None:
    """For each of the row's `total` packed tokens, the first and the second place of its key in `varlen_layout`'s
    key_index (-1 for the second: a key of one sequence only). A pair's prompt token is a key of both its sequences,
    every other token of one; so the gathered keys' gradient comes back to a token as a sum of at most two rows,
    which a kernel adds without atomics. None when a run has more than two completions (its prompt's keys have more
    places: the gather's own backward adds them). Host lists, no device work."""
    if any(len(run) > 3 for run in pair_lengths):
        return None
    first, second = [-1] * total, [-1] * total
    kc = off = 0
    for n_p, *completions in pair_lengths:
        n_c, n_r = (completions + [0, 0])[:2]
        a, b = off + n_p + n_c, off + n_p + n_c + n_r  # where the chosen and the rejected completion end
        if n_p + n_c:  # queries [prompt | chosen] over those keys
            first[off:a] = range(kc, kc + n_p + n_c)
            kc += n_p + n_c
        if n_r:  # queries rejected over [prompt | rejected]
            second[off:off + n_p] = range(kc, kc + n_p)  # a prompt's keys: their second place
            first[a:b] = range(kc + n_p, kc + n_p + n_r)
            kc += n_p + n_r
        off = b
    first[off:total] = range(kc, kc + total - off)  # trailing filler: one more sequence over itself
    return first, second


def varlen_mask(batch: PairBatch) -> VarlenMask:
    """The micro-batch's VarlenMask on the batch's device (copied from pinned host memory without a sync)."""
    assert batch.pair_lengths is not None, "varlen needs the packed layout"
    key_index, cu_q, cu_k, max_q, max_k = varlen_layout(batch.pair_lengths, batch.num_tokens)
    device = batch.input_ids.device
    pin = device.type == "cuda"

    def put(values: list[int], dtype: torch.dtype) -> torch.Tensor:
        t = int_tensor(values, dtype)
        return (t.pin_memory() if pin else t).to(device, non_blocking=True)

    sources = key_sources(batch.pair_lengths, batch.num_tokens)
    first, second = (None, None) if sources is None else (put(sources[0], torch.long), put(sources[1], torch.long))
    return VarlenMask(put(key_index, torch.long), put(cu_q, torch.int32), put(cu_k, torch.int32), length_bound(max_q),
                      length_bound(max_k), first, second)


def length_bound(n: int) -> int:
    """The longest sequence as the kernel is told it: the next power of two (at least 128). The kernel sizes its grid
    by it and skips what lies past each sequence's end, so a bound gives the same result; a few distinct values keep
    a compiled layer from being specialised to every micro-batch's own maximum."""
    return max(128, 1 << (max(n, 1) - 1).bit_length())


def varlen_available() -> bool:
    try:
        from torch.nn.attention import varlen  # noqa: F401
    except ImportError:
        return False
    return True


_VARLEN_API: tuple | None = None  # (varlen_attn, its keyword names), read by `register` before anything compiles


def _varlen_api() -> tuple:
    """torch's varlen_attn and its keyword names. Read once, outside any compiled region (`register` does it before
    the first forward): Dynamo would trace `inspect` otherwise. torch 2.11 takes fewer key/value heads as they are;
    later releases ask for `enable_gqa=True`."""
    global _VARLEN_API
    if _VARLEN_API is None:
        from torch.nn.attention.varlen import varlen_attn

        _VARLEN_API = (varlen_attn, frozenset(inspect.signature(varlen_attn).parameters))
    return _VARLEN_API


@functools.cache
def _flash_ops() -> bool:
    """Whether this torch's FlashAttention ops take what `_Flash` passes them (the varlen offsets, `scale` and the
    window by keyword). Read once, outside any compiled region."""
    try:
        ops = torch.ops.aten._flash_attention_forward.default, torch.ops.aten._flash_attention_backward.default
    except (AttributeError, RuntimeError):
        return False
    need = {"cum_seq_q", "scale", "window_size_left", "window_size_right"}
    return all(need <= {a.name for a in op._schema.arguments} for op in ops)


class _Flash(torch.autograd.Function):
    """FlashAttention's variable-length forward and backward, called as the aten ops themselves. torch's
    `varlen_attn` reaches the same kernels through a Python custom op, whose dispatch, autograd wrapper and per-call
    allocation cost the host about as much as a layer's other launches together: with the default checkpointing, a
    step waited on the CPU."""

    @staticmethod
    def forward(ctx, q, k, v, cu_q, cu_k, max_q: int, max_k: int, scale: float | None, left: int):
        out, lse, seed, offset, _ = torch.ops.aten._flash_attention_forward(
            q, k, v, cu_q, cu_k, max_q, max_k, 0.0, True, False, scale=scale, window_size_left=left,
            window_size_right=0)
        ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k)
        ctx.args = max_q, max_k, scale, left, seed, offset
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse, cu_q, cu_k = ctx.saved_tensors
        max_q, max_k, scale, left, seed, offset = ctx.args
        dq, dk, dv = torch.ops.aten._flash_attention_backward(
            grad.contiguous(), q, k, v, out, lse, cu_q, cu_k, max_q, max_k, 0.0, True, seed, offset, scale=scale,
            window_size_left=left, window_size_right=0)
        return dq, dk, dv, None, None, None, None, None, None


def _varlen_kernel(q, k, v, cu_q, cu_k, max_q: int, max_k: int, scale: float | None, window: int | None):
    """q (Tq, H, D), k/v (Tk, Hkv, D) -> (Tq, H, D): causal within each sequence, aligned to its end. The rule's
    window (q_pos - k_pos < W) is the kernel's (W - 1, 0): W - 1 keys to the left and the token itself. Through
    `_Flash` where this torch's ops allow it, outside compiled regions (which trace torch's `varlen_attn`)."""
    left = -1 if window is None else window - 1
    if q.is_cuda and not torch.compiler.is_compiling() and _flash_ops():
        if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
            return _Flash.apply(q, k, v, cu_q, cu_k, max_q, max_k, scale, left)
        return torch.ops.aten._flash_attention_forward(q, k, v, cu_q, cu_k, max_q, max_k, 0.0, True, False,
                                                       scale=scale, window_size_left=left, window_size_right=0)[0]
    fn, params = _VARLEN_API if _VARLEN_API is not None else _varlen_api()
    kw = {"window_size": (-1, 0) if window is None else (window - 1, 0)}  # a tuple: (-1, 0) is how it knows causal
    if scale is not None:
        kw["scale"] = scale
    if q.shape[1] != k.shape[1] and "enable_gqa" in params:
        kw["enable_gqa"] = True
    return fn(q, k, v, cu_q, cu_k, max_q, max_k, **kw)


def varlen_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers attention function: query (1, H, T, D), key/value (1, Hkv, T, D) -> ((1, T, H, D), None)."""
    window = getattr(module, "_fastdpo_window", None)
    check_window(kwargs, window)
    if "fastdpo_key_index" not in kwargs:
        raise RuntimeError("fastdpo varlen attention needs the micro-batch's offsets; call through "
                           "fastdpo.model.backend.target_hidden")
    index = kwargs["fastdpo_key_index"]
    # squeeze, not [0]: a selection's backward writes its gradient into a zeroed copy of the input's shape (a copy
    # per projection and layer), a squeeze's is a view
    q = query.squeeze(0).transpose(0, 1)  # (T, H, D), packed order: the output comes back in it
    k = gather_keys(module, key.squeeze(0).transpose(0, 1), index, kwargs)  # keys sequence by sequence
    v = gather_keys(module, value.squeeze(0).transpose(0, 1), index, kwargs)
    out = _varlen_kernel(q, k, v, kwargs["fastdpo_cu_q"], kwargs["fastdpo_cu_k"], kwargs["fastdpo_max_q"],
                         kwargs["fastdpo_max_k"], scaling, window)
    return out.unsqueeze(0), None


def gather_keys(module, x: torch.Tensor, index: torch.Tensor, kw: dict) -> torch.Tensor:
    """x (T, Hkv, D) gathered into the keys' sequence-by-sequence order; through `fastdpo.kernels.gather_rows` where
    the module runs the Triton kernels (a fused attention) and the mask carries each token's places, else through
    index_select."""
    first, second = kw.get("fastdpo_key_first"), kw.get("fastdpo_key_second")
    if (first is None or not getattr(module, "_fastdpo_kernels", False) or not kernels_available(x)
            or torch.compiler.is_compiling()):
        return x.index_select(0, index)
    return gather_rows(x, index, first, second)


def switch_attention(root: torch.nn.Module, name: str) -> None:
    """Give every module config under `root` the attention implementation `name` (transformers reads it at each
    forward)."""
    for module in root.modules():
        cfg = getattr(module, "config", None)
        if cfg is not None and getattr(cfg, "_attn_implementation", None) != name:
            cfg._attn_implementation = name


def register() -> None:
    """Make "fastdpo" a valid attn_implementation for transformers models (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_NAME, fastdpo_attention)
    # no mask function for varlen: transformers then builds no mask, and the offsets come as keyword arguments
    AttentionInterface.register(VARLEN_NAME, varlen_attention)
    if varlen_available():
        _varlen_api()
        _flash_ops()
    try:
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

        # Our masks arrive ready-made; this entry only matters if a caller passes none (e.g. generation).
        ALL_MASK_ATTENTION_FUNCTIONS.register(ATTN_NAME, sdpa_mask)
    except ImportError:  # pragma: no cover - older transformers
        pass
