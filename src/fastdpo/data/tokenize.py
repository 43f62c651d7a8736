"""Tokenise plain-text pairs exactly as TRL 1.x does, so log-probs are comparable on the same rows and model.

TRL: EOS text appended to each completion (unless present), then `tok(prompt)` and `tok(prompt + completion)` with the
tokenizer's own special tokens; the completion starts where the two token lists diverge.
"""

from __future__ import annotations

from dataclasses import dataclass

from fastdpo.data.load import Row
from fastdpo.errors import FastDPOError


@dataclass
class TokenizedPair:
    """Token ids of one pair. `index` is the row's position in the dataset (stable across runs)."""

    prompt: list[int]
    chosen: list[int]
    rejected: list[int]
    index: int

    @property
    def num_tokens(self) -> int:
        """Tokens in the shared layout: P + C + R."""
        return len(self.prompt) + len(self.chosen) + len(self.rejected)


@dataclass
class TokenizeStats:
    rows: int = 0
    dropped_prompt_too_long: int = 0
    truncated: int = 0


def common_prefix_length(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def tokenize_rows(
    tokenizer, rows: list[Row], max_length: int, chunk: int = 512
) -> tuple[list[TokenizedPair], TokenizeStats]:
    """Tokenise rows in batches. Sequences longer than `max_length` keep their start (TRL `keep_start`):
    completions are cut; a pair whose prompt alone fills `max_length` is dropped and counted."""
    eos = tokenizer.eos_token
    if eos is None:
        raise FastDPOError(
            "The tokenizer has no eos_token: completions cannot be terminated. "
            "Set eos_token in the model dir's tokenizer_config.json."
        )
    stats = TokenizeStats(rows=len(rows))
    out: list[TokenizedPair] = []
    for start in range(0, len(rows), chunk):
        part = rows[start : start + chunk]
        chosen = [r.chosen if r.chosen.endswith(eos) else r.chosen + eos for r in part]
        rejected = [r.rejected if r.rejected.endswith(eos) else r.rejected + eos for r in part]
        prompts = [r.prompt for r in part]
        p_ids = tokenizer(prompts)["input_ids"]
        pc_ids = tokenizer([p + c for p, c in zip(prompts, chosen)])["input_ids"]
        pr_ids = tokenizer([p + r for p, r in zip(prompts, rejected)])["input_ids"]
        for k, (p, pc, pr) in enumerate(zip(p_ids, pc_ids, pr_ids)):
            plen = min(common_prefix_length(p, pc), common_prefix_length(p, pr))
            c, r = pc[plen:], pr[plen:]
            if plen >= max_length:
                stats.dropped_prompt_too_long += 1
                continue
            room = max_length - plen
            if len(c) > room or len(r) > room:
                stats.truncated += 1
                c, r = c[:room], r[:room]
            if not c or not r:
                raise FastDPOError(
                    f"{part[k].source}: a completion tokenises to nothing after the prompt. "
                    "Check that chosen/rejected are not contained in the prompt."
                )
            out.append(TokenizedPair(pc[:plen], c, r, start + k))
    if not out:
        raise FastDPOError(
            f"No pair fits --max_length {max_length}: every prompt is at least that long. Raise --max_length."
        )
    return out, stats
