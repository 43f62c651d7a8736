"""Attention for the packed, prefix-shared pair layout (DESIGN §1, §3).

Rule for query q and key k: same pair, k <= q in packed order, and k is a prompt token or in q's own segment
(rejected never sees chosen). An optional sliding window is folded in through the position ids.

Backends: `dense` (boolean mask through SDPA; CPU and tests), `flex` (FlexAttention BlockMask, built once per
micro-batch and shared by all layers; CUDA). Both plug into transformers models as the attention function
"fastdpo", with the mask passed as a ready 4-D `attention_mask` that transformers forwards untouched.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from fastdpo.data.pack import PROMPT, PairBatch

ATTN_NAME = "fastdpo"
FLEX_BLOCK = 128


def allowed(q_pair, k_pair, q_seg, k_seg, q_idx, k_idx, q_pos, k_pos, window: int | None):
    """The attention rule, written once, elementwise on broadcastable tensors."""
    ok = (q_pair == k_pair) & (k_idx <= q_idx) & ((k_seg == PROMPT) | (k_seg == q_seg))
    if window is not None:
        ok = ok & (q_pos - k_pos < window)
    return ok


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


def _check_window(kwargs: dict, window: int | None) -> None:
    sw = kwargs.get("sliding_window")
    assert sw is None or sw == window, f"layer asks for sliding window {sw}, mask was built with {window}"


def fastdpo_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers attention function. query (B, H, T, D), key/value (B, Hkv, T, D) -> ((B, T, H, D), None)."""
    _check_window(kwargs, getattr(module, "_fastdpo_window", None))
    if attention_mask is None:
        raise RuntimeError("fastdpo attention needs the packed-layout mask; call through fastdpo.model.core.forward_hidden")
    gqa = query.shape[1] != key.shape[1]
    if isinstance(attention_mask, torch.Tensor):
        out = F.scaled_dot_product_attention(
            query, key, value, attn_mask=attention_mask, scale=scaling,
            dropout_p=dropout if module.training else 0.0, enable_gqa=gqa,
        )
    else:
        out = _compiled_flex()(query, key, value, block_mask=attention_mask, scale=scaling, enable_gqa=gqa)
    return out.transpose(1, 2).contiguous(), None


def register() -> None:
    """Make "fastdpo" a valid attn_implementation for transformers models (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_NAME, fastdpo_attention)
    try:
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

        # Our masks arrive ready-made; this entry only matters if a caller passes none (e.g. generation).
        ALL_MASK_ATTENTION_FUNCTIONS.register(ATTN_NAME, sdpa_mask)
    except ImportError:  # pragma: no cover - older transformers
        pass
