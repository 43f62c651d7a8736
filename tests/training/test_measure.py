"""FLOPs and MFU, accounted once (`training.measure`) for the loop's logged `mfu` and `fastdpo bench`."""

from types import SimpleNamespace

import pytest

from fastdpo.data.tokenize import TokenizedPair
from fastdpo.training.measure import mfu, pairs_flops

# hidden 8, 2 layers, 2 heads of 4 (no grouped keys), intermediate 16, vocabulary 10
CONFIG = SimpleNamespace(hidden_size=8, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                         head_dim=4, intermediate_size=16, vocab_size=10)


def test_pairs_flops_by_hand():
    pairs = [TokenizedPair(prompt=[1, 2], chosen=[3], rejected=[4, 5], index=0),
             TokenizedPair(prompt=[], chosen=[6, 7], rejected=[8], index=1)]
    per_token = 2 * 2 * (8 * 4 * (2 + 2 * 2) + 2 * 4 * 8 + 3 * 8 * 16)  # 2 x layers x (qkv + o + mlp)
    tokens, completion = 5 + 3, 3 + 3
    # (query, key) pairs: prompt 2 -> 3, chosen 1 -> 1 x 2 + 1, rejected 2 -> 2 x 2 + 3; then 0 + 3 + 1
    attended = (3 + 3 + 7) + (0 + 3 + 1)
    attention = 4 * 2 * 2 * 4 * attended
    head = 2 * 8 * 10 * completion
    for online, passes in ((True, 4), (False, 3)):
        want = passes * (per_token * tokens + attention + head)
        assert pairs_flops(CONFIG, pairs, with_reference=online) == pytest.approx(want, rel=1e-12)


def test_mfu_by_hand():
    assert mfu(6e12, 2.0, 1e12) == pytest.approx(3.0)
    assert mfu(6e12, 2.0, 1e12, devices=4) == pytest.approx(0.75)
