"""The FlexAttention BlockMask built from the attention rule in plain tensor ops equals what torch's own
`create_block_mask` builds from the same rule: the same full and partial blocks in the same order, the same
transposed (query-side) lists, the same dense mask; with and without a sliding window, across chunk boundaries."""

import pytest
import torch
from data_helpers import random_pairs
from torch.nn.attention.flex_attention import create_block_mask

from fastdpo.data.pack import pack_pairs
from fastdpo.model import attention
from fastdpo.model.attention import FLEX_BLOCK, allowed, dense_mask, flex_block_mask


def reference(batch, window):
    pid, seg, pos = batch.pair_ids, batch.segments, batch.position_ids[0]

    def mask_mod(b, h, q, k):
        return allowed(pid[q], pid[k], seg[q], seg[k], q, k, pos[q], pos[k], window)

    t = pid.numel()
    return create_block_mask(mask_mod, None, None, t, t, device="cpu", BLOCK_SIZE=FLEX_BLOCK, _compile=False)


FIELDS = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices", "q_num_blocks", "q_indices",
          "full_q_num_blocks", "full_q_indices")


@pytest.mark.parametrize("seed,window,chunk", [(0, None, None), (1, None, 3 * FLEX_BLOCK * 1024),
                                               (2, 90, None), (3, 300, 2 * FLEX_BLOCK * 896)])
def test_block_mask_equals_create_block_mask(seed, window, chunk, monkeypatch):
    if chunk is not None:  # a few query blocks per chunk: the chunk boundaries are exercised
        monkeypatch.setattr(attention, "MASK_CHUNK", chunk)
    pairs = random_pairs(9, 100, seed=seed, max_prompt=200, max_comp=160)
    batch = pack_pairs(pairs, FLEX_BLOCK * 2)
    ours, theirs = flex_block_mask(batch, window), reference(batch, window)
    for name in FIELDS:
        a, b = getattr(ours, name), getattr(theirs, name)
        assert a.dtype == b.dtype and torch.equal(a, b), name
    assert torch.equal(ours.to_dense(), theirs.to_dense())
    t = batch.input_ids.shape[1]
    block_any = dense_mask(batch, window)[0, 0].view(t // FLEX_BLOCK, FLEX_BLOCK, t // FLEX_BLOCK, FLEX_BLOCK)
    assert torch.equal(ours.to_dense()[0, 0].bool(), block_any.any(3).any(1))  # some allowed entry <=> listed


def test_flex_forward_with_our_block_mask_matches_dense():
    """FlexAttention (forward, CPU) under our BlockMask gives SDPA's output under the dense mask."""
    from torch.nn.attention.flex_attention import flex_attention

    pairs = random_pairs(5, 100, seed=7, max_prompt=150, max_comp=120)
    batch = pack_pairs(pairs, FLEX_BLOCK)
    t = batch.input_ids.shape[1]
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, t, 16, generator=g) for _ in range(3))
    got = flex_attention(q, k, v, block_mask=flex_block_mask(batch))
    mask = dense_mask(batch)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    rows = mask[0, 0].any(-1)  # every query sees itself, so every row has an allowed key
    assert rows.all()
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_block_mask_keeps_the_sequence_length():
    batch = pack_pairs(random_pairs(3, 100, seed=5, max_prompt=90, max_comp=60), FLEX_BLOCK)
    t = batch.input_ids.shape[1]
    assert flex_block_mask(batch).seq_lengths == (t, t) == reference(batch, None).seq_lengths
