"""Prompt groups in the packed layout: the pairs of one prompt as [prompt | y1 | ... | yK], each distinct completion
once, against the plain computation (padded rows, one forward per sequence, float32); K = 2 is the pair layout."""

import random

import pytest
import torch
from data_helpers import easy_rows, random_pairs, write_jsonl
from dist_helpers import assert_weights_close, metrics, run_ranks, weights
from model_helpers import admitted

from fastdpo.config import TrainConfig
from fastdpo.data.pack import pack_pairs, packed_tokens, pad_pairs, prompt_groups, split_micro_batches
from fastdpo.data.tokenize import TokenizedPair
from fastdpo.model.attention import dense_mask, key_sources, varlen_layout

KEYS = ("loss", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected", "grad_norm",
        "logps/chosen_per_token", "logps/rejected_per_token", "logratio/mean")


def shared_pairs(n_prompts: int = 4, per_prompt: int = 3, vocab: int = 50, seed: int = 0) -> list[TokenizedPair]:
    """Pairs of a few prompts, several per prompt, some completions used by several pairs; shuffled, so a prompt's
    pairs are not adjacent."""
    rng = random.Random(seed)
    word = lambda n: [rng.randrange(3, vocab) for _ in range(n)]  # noqa: E731
    pairs = []
    for _ in range(n_prompts):
        prompt = word(rng.randint(1, 9))
        pool = [word(rng.randint(1, 6)) for _ in range(per_prompt)]
        for k in range(per_prompt):
            pairs.append(TokenizedPair(prompt, pool[0] if k % 2 == 0 else word(rng.randint(1, 6)),
                                       pool[k] if k else word(3), index=len(pairs)))
    pairs += random_pairs(3, vocab, seed=seed + 1)  # prompts of their own
    for i, p in enumerate(pairs):
        p.index = i
    rng.shuffle(pairs)
    return pairs


def test_pairs_with_prompts_of_their_own_pack_exactly_as_pairs():
    pairs = random_pairs(12, 50, seed=2)
    a, b = pack_pairs(pairs, 16, prompt_targets=True), pack_pairs(pairs, 16, prompt_targets=True, group=True)
    for name, value in vars(a).items():
        other = getattr(b, name)
        assert (torch.equal(value, other) if isinstance(value, torch.Tensor) else value == other), name
    assert b.seq_alias is None and b.prompt_alias is None


def test_a_group_computes_its_prompt_and_each_distinct_completion_once():
    pairs = shared_pairs()
    batch = pack_pairs(pairs, group=True)
    groups = prompt_groups(pairs)
    assert batch.num_tokens == packed_tokens(pairs, group=True) < packed_tokens(pairs)
    assert len(batch.pair_lengths) == len(groups)
    distinct = sum(len({tuple(c) for p in g for c in (p.chosen, p.rejected)}) for g in groups)
    assert sum(len(run) - 1 for run in batch.pair_lengths) == distinct
    assert batch.seq_alias is not None
    b = len(pairs)
    for i, p in enumerate(pairs):  # every sequence reads the targets of its own completion
        for s, toks in ((i, p.chosen), (b + i, p.rejected)):
            held = int(batch.seq_alias[s])
            got = batch.tgt[batch.seq == held].tolist()
            assert got == (toks if p.prompt else toks[1:]) and int(batch.lengths[s]) == len(got)


@pytest.mark.parametrize("window", [None, 2])
def test_varlen_offsets_admit_exactly_the_group_rule(window):
    pairs = shared_pairs(seed=3)
    for pad in (1, 16):
        batch = pack_pairs(pairs, pad, group=True)
        got = admitted(batch.pair_lengths, batch.num_tokens, window)
        want = dense_mask(batch, window)[0, 0]
        real = batch.pair_ids >= 0
        assert torch.equal(got[real][:, real], want[real][:, real])
    assert key_sources(batch.pair_lengths, batch.num_tokens) is None  # prompts of more than two completions
    two = pack_pairs(random_pairs(4, 50), group=True)
    assert key_sources(two.pair_lengths, two.num_tokens) is not None
    keys, cu_q, *_ = varlen_layout(two.pair_lengths, two.num_tokens)
    assert len(cu_q) - 1 == 2 * 4


def sums(model, batch, backend, wpo=True):
    from fastdpo.model.backend import build_mask
    from fastdpo.model.seqlogps import completion_logps

    return completion_logps(model, batch, backend, build_mask(batch, backend), wpo=wpo)


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_grouped_log_probs_equal_one_padded_row_per_sequence(model_dirs, family):
    from transformers import AutoModelForCausalLM

    from fastdpo.model.backend import Backend, prepare_packed

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(str(model_dirs(family)), dtype=torch.float32)
    pairs = shared_pairs(seed=5)
    want = sums(model, pad_pairs(pairs, prompt_targets=True), Backend("padded"))
    dense = Backend("dense")
    prepare_packed(model, dense)
    got = sums(model, pack_pairs(pairs, prompt_targets=True, group=True), dense)
    for name in ("sums", "wpo", "prompt"):
        torch.testing.assert_close(getattr(got, name), getattr(want, name), rtol=1e-5, atol=1e-5)
    # without deduplication every pair has its own two sequences, so LD-DPO's shared sums are each pair's own too
    nodup = sums(model, pack_pairs(pairs, prompt_targets=True, group=True, dedupe=False), dense)
    for name in ("sums", "shared", "wpo", "prompt"):
        torch.testing.assert_close(getattr(nodup, name), getattr(want, name), rtol=1e-5, atol=1e-5)


def test_micro_batches_keep_a_prompts_pairs_together():
    pairs = shared_pairs(n_prompts=3, per_prompt=4, seed=7)
    largest = max(packed_tokens(g, True) for g in prompt_groups(pairs))
    bins = split_micro_batches(pairs, largest, 2, group=True)
    assert sorted(p.index for b in bins for p in b) == sorted(p.index for p in pairs)
    for g in prompt_groups(pairs):
        assert sum(any(p in b for p in g) for b in bins) == 1  # each prompt's pairs in one micro-batch
    assert all(packed_tokens(b, True) <= largest for b in bins)
    small = split_micro_batches(pairs, largest - 1, 2, group=True)  # a group over the budget is cut, never lost
    assert sorted(p.index for b in small for p in b) == sorted(p.index for p in pairs)
    assert all(packed_tokens(b, True) <= largest - 1 or len(b) == 1 for b in small)
    own = random_pairs(9, 50, seed=1)  # no shared prompt: the same micro-batches as without groups
    assert split_micro_batches(own, 40, 2, group=True) == split_micro_batches(own, 40, 2)


def grouped_rows(n_prompts: int = 6, per_prompt: int = 3) -> list[dict]:
    base = easy_rows(n_prompts * per_prompt, seed=4)
    rows = []
    for g in range(n_prompts):
        for k in range(per_prompt):
            r = base[g * per_prompt + k]
            rows.append({"prompt": base[g * per_prompt]["prompt"], "chosen": base[g * per_prompt]["chosen"],
                         "rejected": r["rejected"]})
    return rows


def run(tmp_path, model_dirs, name, **kw):
    from fastdpo.training.loop import train

    data = write_jsonl(tmp_path / "rows.jsonl", grouped_rows())
    base = dict(model=str(model_dirs("qwen3")), dataset=[str(data)], max_steps=2, per_device_train_batch_size=5,
                gradient_accumulation_steps=1, learning_rate=1e-3, seed=3, logging_steps=1,
                gradient_checkpointing="none")
    train(TrainConfig(output_dir=str(tmp_path / name), **{**base, **kw}), progress=False)
    return tmp_path / name


def assert_same(a, b):
    assert_weights_close(weights(a), weights(b), atol=1e-4)
    for x, y in zip(metrics(a), metrics(b), strict=True):
        for key in KEYS:
            if key in x or key in y:
                assert x[key] == pytest.approx(y[key], rel=1e-5, abs=1e-5), key


@pytest.mark.parametrize("kw", [
    {},
    {"max_tokens_per_batch": 96},  # several micro-batches, groups cut where they exceed the budget
    {"precompute_ref_log_probs": True},
    {"loss_type": "orpo"},  # prompt targets, once per group
    {"loss_type": "sigmoid", "ld_alpha": 0.5},  # no deduplication
    {"gradient_checkpointing": "full"},
])
def test_grouped_training_equals_one_run_per_pair(tmp_path, model_dirs, kw):
    assert_same(run(tmp_path, model_dirs, "grouped", **kw), run(tmp_path, model_dirs, "pairs", group_prompts=False, **kw))


def test_grouped_training_under_sequence_parallelism(tmp_path, model_dirs):
    one = run(tmp_path, model_dirs, "one", group_prompts=False)
    data = tmp_path / "rows.jsonl"
    out = tmp_path / "sp2"
    run_ranks(2, output_dir=str(out), model=str(model_dirs("qwen3")), dataset=[str(data)], max_steps=2,
              per_device_train_batch_size=5, gradient_accumulation_steps=1, learning_rate=1e-3, seed=3,
              logging_steps=1, gradient_checkpointing="none", sequence_parallel_size=2)
    assert_same(out, one)


def test_training_groups_by_default_and_the_flag_turns_it_off(tmp_path, model_dirs):
    from fastdpo.training.trainer import Trainer

    data = write_jsonl(tmp_path / "rows.jsonl", grouped_rows())
    common = dict(model=str(model_dirs("qwen3")), dataset=[str(data)], output_dir=str(tmp_path / "o"), max_steps=1,
                  gradient_checkpointing="none")
    on = Trainer(TrainConfig(**common)).s.backend
    assert (on.group, on.dedupe) == (True, True)
    assert not Trainer(TrainConfig(group_prompts=False, **common)).s.backend.group
    assert not Trainer(TrainConfig(ld_alpha=0.5, **common)).s.backend.dedupe
    assert not Trainer(TrainConfig(attn_impl="padded", **common)).s.backend.group


def test_a_prompts_run_of_pairs_is_shuffled_as_a_whole():
    from fastdpo.data.pack import epoch_permutation, prompt_runs, step_order

    own = random_pairs(10, 50, seed=1)
    assert prompt_runs(own) is None
    assert torch.equal(epoch_permutation(10, 3, 1), epoch_permutation(10, 3, 1, runs=None))
    p, q = TokenizedPair([1, 2], [3], [4], 0), TokenizedPair([5], [3], [4], 0)
    runs = prompt_runs([p, p, p, q, p, q, q])
    assert runs == [3, 1, 1, 2]
    for epoch in range(5):
        perm = epoch_permutation(7, 0, epoch, runs=runs).tolist()
        assert sorted(perm) == list(range(7))
        for block in ([0, 1, 2], [5, 6]):
            at = perm.index(block[0])
            assert perm[at:at + len(block)] == block
    assert step_order(7, 3, 0, 0, False, runs) == [[0, 1, 2], [3, 4, 5], [6]]


def test_mfu_counts_what_a_group_computes():
    """The useful FLOPs of a grouped step count each prompt once and each distinct completion once; pairs with prompts
    of their own count as before."""
    from transformers import Qwen3Config

    from fastdpo.observe.metrics import step_flops
    from fastdpo.training.measure import pairs_flops

    cfg = Qwen3Config(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    own = random_pairs(6, 50, seed=2)
    assert pairs_flops(cfg, own, True, group=True) == pairs_flops(cfg, own, True)
    p, c = [1] * 10, [2] * 4
    pairs = [TokenizedPair(p, c, [3] * 5, 0), TokenizedPair(p, c, [4] * 6, 1)]  # one prompt, chosen shared
    attended = 10 * 11 // 2 + sum(n * 10 + n * (n + 1) // 2 for n in (4, 5, 6))
    assert pairs_flops(cfg, pairs, True, group=True) == step_flops(cfg, 10 + 15, 15, attended, True)
    assert pairs_flops(cfg, pairs, True, group=True) < pairs_flops(cfg, pairs, True)


def test_ranks_get_a_prompts_pairs_together():
    from fastdpo.parallel.split import split_ranks

    own = random_pairs(12, 50, seed=4)
    assert split_ranks(own, 3, group=True) == split_ranks(own, 3)  # no shared prompt: dealt as before
    pairs = shared_pairs(n_prompts=3, per_prompt=2, seed=8)  # 3 prompts of 2 pairs, 3 pairs of their own
    shares = split_ranks(pairs, 3, group=True)
    assert [len(s) for s in shares] == [3, 3, 3]
    assert sorted(p.index for s in shares for p in s) == sorted(p.index for p in pairs)
    for g in prompt_groups(pairs):
        assert sum(any(p in s for p in g) for s in shares) == 1
    big = shared_pairs(n_prompts=1, per_prompt=5, seed=9)  # more pairs than a rank's room: dealt pair by pair
    assert [len(s) for s in split_ranks(big, 2, group=True)] == [4, 4]


def test_grouped_training_on_two_data_parallel_ranks(tmp_path, model_dirs):
    one = run(tmp_path, model_dirs, "one", group_prompts=False, per_device_train_batch_size=10)
    out = tmp_path / "dp2"
    run_ranks(2, output_dir=str(out), model=str(model_dirs("qwen3")), dataset=[str(tmp_path / "rows.jsonl")],
              max_steps=2, per_device_train_batch_size=5, gradient_accumulation_steps=1, learning_rate=1e-3, seed=3,
              logging_steps=1, gradient_checkpointing="none")
    assert_same(out, one)
