"""The anchor workload: synthetic pairs whose lengths follow a real-world spread (log-normal; prompt mean ~303 tokens,
chosen ~385, rejected ~373, pair <= 2048 tokens), texts of words `t<id>` that a word-level tokenizer maps one to one
onto a 151,936-entry vocabulary (Qwen3's), so lengths are exact and nothing is downloaded."""

from __future__ import annotations

import random

VOCAB = 151936


def anchor_pairs(n: int, vocab: int = VOCAB, seed: int = 1, prompt_mean: int = 256, resp_mean: int = 320,
                 max_total: int = 2048, max_prompt: int = 1024, within_total: bool = False) -> list[dict]:
    """The anchor rule: log-normal lengths, words t<id> drawn from one seeded stream (same rule and seed as the
    reference benchmark, so the rows are identical). Each completion is capped at `max_total` minus the prompt;
    with `within_total`, at half of that, so every pair fits in `max_total` tokens."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        p = max(16, min(int(rng.lognormvariate(0, 0.6) * prompt_mean), max_prompt))
        cap = (max_total - p) // 2 if within_total else (max_total - p) - 1
        c = max(8, min(int(rng.lognormvariate(0, 0.6) * resp_mean), cap))
        r = max(8, min(int(rng.lognormvariate(0, 0.6) * resp_mean), cap))

        def words(k: int) -> str:
            return " ".join(f"t{rng.randrange(10, vocab)}" for _ in range(k))

        out.append({"prompt": words(p) + " ", "chosen": words(c), "rejected": words(r)})
    return out


# The benchmark workloads: (prompt mean, completion mean, longest pair) of the same log-normal rule. `anchor` is the
# reference benchmark's; `long-prompt` is retrieval or document QA (prompts ~1,600 tokens, answers ~190), `long-answer`
# is reasoning or code (prompts ~70 tokens, answers ~900).
# Long workloads keep every pair within their length (`within_total`). `grouped` is several completions per prompt
# (UltraFeedback-style, on-policy samples): prompts of 500 to 1,024 tokens (~660), each with one chosen and
# PAIRS_PER_PROMPT rejected answers (~330 tokens), written as that many consecutive pairs.
WORKLOADS = {"anchor": (256, 320, 2048, 1024), "long-prompt": (1500, 180, 4096, 3072),
             "long-answer": (64, 850, 4096, 512), "grouped": (600, 300, 2048, 1024)}
PAIRS_PER_PROMPT = 4


def workload_pairs(name: str, n: int, vocab: int = VOCAB, seed: int = 1) -> list[dict]:
    """`n` rows of a named workload (`WORKLOADS`); `anchor` is `anchor_pairs` itself."""
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}: choose from {', '.join(WORKLOADS)}")
    prompt_mean, resp_mean, max_total, max_prompt = WORKLOADS[name]
    if name == "grouped":
        return grouped_pairs(n, vocab, seed, prompt_mean, resp_mean, max_total, max_prompt)
    return anchor_pairs(n, vocab, seed, prompt_mean, resp_mean, max_total, max_prompt, within_total=name != "anchor")


def grouped_pairs(n: int, vocab: int = VOCAB, seed: int = 1, prompt_mean: int = 600, resp_mean: int = 300,
                  max_total: int = 2048, max_prompt: int = 1024, per_prompt: int = PAIRS_PER_PROMPT) -> list[dict]:
    """`n` pairs, `per_prompt` consecutive ones per prompt: the prompt's chosen answer against each of its rejected
    ones (the same log-normal rule; prompts at least 500 tokens, every pair within `max_total`)."""
    rng = random.Random(seed)

    def words(k: int) -> str:
        return " ".join(f"t{rng.randrange(10, vocab)}" for _ in range(k))

    def answer(cap: int) -> str:
        return words(max(8, min(int(rng.lognormvariate(0, 0.6) * resp_mean), cap)))

    out: list[dict] = []
    while len(out) < n:
        p = max(500, min(int(rng.lognormvariate(0, 0.4) * prompt_mean), max_prompt))
        cap = (max_total - p) // 2
        prompt, chosen = words(p) + " ", answer(cap)
        out += [{"prompt": prompt, "chosen": chosen, "rejected": answer(cap)} for _ in range(per_prompt)]
    return out[:n]


def workload_max_length(name: str) -> int:
    return WORKLOADS[name][2]


def anchor_tokenizer(vocab: int = VOCAB):
    """Word-level tokenizer: `t<i>` -> i, specials <unk> <pad> <eos> <bos> -> 0..3."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<pad>", "<eos>", "<bos>"]
    v = {s: i for i, s in enumerate(specials)}
    v.update({f"t{i}": i for i in range(len(specials), vocab)})
    tok = Tokenizer(models.WordLevel(vocab=v, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>", eos_token="<eos>",
                                   bos_token="<bos>")


def long_pair_rows(total: int, vocab: int = VOCAB, seed: int = 1) -> dict:
    """One pair of about `total` tokens: prompt half, chosen and rejected a quarter each."""
    rng = random.Random(seed + total)

    def words(k: int) -> str:
        return " ".join(f"t{rng.randrange(10, vocab)}" for _ in range(k))

    return {"prompt": words(total // 2) + " ", "chosen": words(total // 4), "rejected": words(total // 4)}
