"""Step sampling and packing: which pairs form an optimizer step, and how a step's pairs become micro-batches.

The packed layout of one pair (DESIGN §1):

    tokens    p0 .. pP-1 | c0 .. cC-1   | r0 .. rR-1
    position  0  .. P-1  | P  .. P+C-1  | P  .. P+R-1
    segment   0          | 1            | 2

Targets: c0 and r0 are predicted by the hidden state of p(P-1); c_i by c_(i-1); r_i by r_(i-1).
Prompt targets, only when asked for (`prompt_targets`: a loss whose NLL covers the prompt, ORPO): p_i (i >= 1) by
p_(i-1), once per pair (the prompt is shared by both sequences). p0, the first token of the sequence, is never
predicted.

Groups (`group=True`): the pairs of a micro-batch whose prompts are the same token ids share one run

    tokens    p0 .. pP-1 | y1 .. | y2 .. | ... | yK ..      (every completion restarts at position P)
    segment   0          | 1     | 2     | ... | K

where y1..yK are the distinct completions of those pairs (with `dedupe`; else each pair's two), each attending to the
prompt and to itself. A completion used by several pairs is computed once: its targets belong to the first
sequence that uses it, and `seq_alias` maps every sequence (chosen of pair i -> i, rejected -> B + i) to the one
holding its targets, so each pair still sees its own two sums. Pairs with prompts of their own are K = 2 groups:
exactly the pair layout above.
"""

from __future__ import annotations

import array
from dataclasses import dataclass

import torch

from fastdpo.data.tokenize import TokenizedPair

PROMPT, CHOSEN, REJECTED = 0, 1, 2


@dataclass
class PairBatch:
    """A micro-batch of B pairs.

    Packed layout (`attention_mask is None`): every tensor of length T describes one packed row of T tokens.
      input_ids, position_ids: (1, T) long; pair_ids: (T,) int32 (-1 for filler); segments: (T,) int8.
    Padded layout: input_ids, position_ids, attention_mask: (2B, L); rows 0..B-1 prompt+chosen, B..2B-1
      prompt+rejected; pair_ids and segments are None.
    Both layouts: src (N,) long indexes the flattened hidden states that predict the N completion targets `tgt` (N,);
      seq (N,) long maps each target to a sequence: chosen of pair i -> i, rejected -> B + i;
      lengths (2B,) long completion tokens per sequence; index (B,) long dataset row of each pair.
    Packed layout only: pair_lengths, on the host, (prompt, chosen, rejected) tokens of each pair in packed order
      (the attention backends that take sequence offsets build them from it without reading the device).
    Prompt targets (both layouts, None unless the batch was built with `prompt_targets`): prompt_src (M,) long
      indexes the flattened hidden states that predict the M prompt tokens `prompt_tgt` (M,) (p_i by p_(i-1),
      i >= 1; in the padded layout from the chosen rows); prompt_pair (M,) long maps each to its pair;
      prompt_lengths (B,) long counts them per pair (prompt tokens - 1, or 0 without a prompt).
    A shard of a packed row (sequence parallelism: some of its tokens, some of its targets) also has offsets (N,)
      long, each target's position within its sequence in the whole row; lengths stay the whole row's.
    Groups (packed layout, see the module docstring): pair_ids then number the groups, segments the completions of a
      group (1..K), pair_lengths holds (prompt, y1, ..., yK) per group; seq_alias (2B,) long, when some sequence
      has no targets of its own, maps each sequence to the one whose sums it takes; prompt_alias (B,) likewise for
      the prompt targets (held by the first pair of each group).
    Pairs with images (vision-language models, `fastdpo.model.vlm`; grouped only where a prompt's pairs hold the same
      images): pixel_values and image_grid_thw (I, 3) long, the images in the order their placeholders appear in
      input_ids (run after run; in the padded layout each pair's images twice, for its chosen and its rejected row);
      in the packed layout vision_positions (3, 1, T) long, the M-RoPE positions (position_ids stays the plain
      one-axis numbering).
    unit_heads (packed layout, host): for each run of pair_lengths, the index in the given pairs of the pair whose
      prompt heads it (its first member), so what belongs to a prompt (its images) is placed once per run.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    src: torch.Tensor
    tgt: torch.Tensor
    seq: torch.Tensor
    lengths: torch.Tensor
    index: torch.Tensor
    pair_ids: torch.Tensor | None = None
    segments: torch.Tensor | None = None
    attention_mask: torch.Tensor | None = None
    pair_lengths: tuple[tuple[int, int, int], ...] | None = None
    prompt_src: torch.Tensor | None = None
    prompt_tgt: torch.Tensor | None = None
    prompt_pair: torch.Tensor | None = None
    prompt_lengths: torch.Tensor | None = None
    offsets: torch.Tensor | None = None
    seq_alias: torch.Tensor | None = None
    prompt_alias: torch.Tensor | None = None
    pixel_values: torch.Tensor | None = None
    image_grid_thw: torch.Tensor | None = None
    vision_positions: torch.Tensor | None = None
    unit_heads: tuple[int, ...] | None = None

    @property
    def num_pairs(self) -> int:
        return int(self.index.numel())

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())

    def to(self, device: torch.device | str) -> PairBatch:
        # pinned host memory: the copy is queued behind the running step instead of waiting for it (no host sync)
        pin = torch.device(device).type == "cuda"

        def move(v):
            if not isinstance(v, torch.Tensor):
                return v
            return (v.pin_memory() if pin and v.device.type == "cpu" else v).to(device, non_blocking=True)

        return PairBatch(**{k: move(v) for k, v in vars(self).items()})


_TYPECODES = {torch.long: "q", torch.int32: "i", torch.int8: "b"}


def int_tensor(values: list[int], dtype: torch.dtype = torch.long) -> torch.Tensor:
    """A 1-D CPU tensor of Python ints, through `array.array`: a few times faster than `torch.tensor` on a list,
    which the host pays for every micro-batch (thousands of tokens, about a dozen lists)."""
    if not values:
        return torch.empty(0, dtype=dtype)
    return torch.frombuffer(array.array(_TYPECODES[dtype], values), dtype=dtype)


def run_lengths(keys: list) -> list[int]:
    """Lengths of the runs of consecutive equal keys, in order."""
    runs: list[int] = []
    for i, key in enumerate(keys):
        if i and key == keys[i - 1]:
            runs[-1] += 1
        else:
            runs.append(1)
    return runs


def prompt_runs(pairs: list[TokenizedPair]) -> list[int] | None:
    """Lengths of the runs of consecutive pairs with the same prompt (a record of several completions, or rows
    written one pair per line in prompt order); None when every run is one pair."""
    runs = run_lengths([p.prompt for p in pairs])
    return runs if len(runs) < len(pairs) else None


def epoch_permutation(num_rows: int, seed: int, epoch: int, shuffle: bool = True,
                      runs: list[int] | None = None) -> torch.Tensor:
    """The dataset indices of one epoch in training's order: seeded by (seed, epoch); without `shuffle`, the
    dataset order. With `runs` (`prompt_runs`) the runs of one prompt are shuffled as wholes, each in dataset order,
    so a prompt's pairs meet in a step and share its computation (with or without grouping: the steps are the
    same); a run of one pair moves as a pair does without runs."""
    if not shuffle:
        return torch.arange(num_rows)
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    if runs is None:
        return torch.randperm(num_rows, generator=g)
    starts = torch.tensor([0] + runs[:-1]).cumsum(0)
    order = torch.randperm(len(runs), generator=g)
    return torch.cat([torch.arange(int(starts[r]), int(starts[r]) + runs[r]) for r in order.tolist()])


def step_order(num_rows: int, pairs_per_step: int, seed: int, epoch: int, shuffle: bool = True,
               runs: list[int] | None = None) -> list[list[int]]:
    """Dataset indices of each optimizer step in one epoch. Depends only on the seed, the epoch, the step size and
    the prompt runs, never on micro-batching or the token budget. The last step of an epoch may be smaller. Without
    `shuffle`, the dataset order."""
    perm = epoch_permutation(num_rows, seed, epoch, shuffle, runs).tolist()
    return [perm[i : i + pairs_per_step] for i in range(0, num_rows, pairs_per_step)]


def unit_step_order(units: list[int], units_per_step: int, seed: int, epoch: int, shuffle: bool = True
                    ) -> list[list[int]]:
    """Dataset indices of each optimizer step in one epoch when a step counts units of consecutive pairs (`units`:
    their sizes; a ranking's adjacent pairs) rather than pairs: the units shuffled as wholes (seeded by seed and
    epoch), `units_per_step` of them per step; the last step may be smaller."""
    starts = [0]
    for n in units[:-1]:
        starts.append(starts[-1] + n)
    order = epoch_permutation(len(units), seed, epoch, shuffle).tolist()
    return [[j for u in order[i: i + units_per_step] for j in range(starts[u], starts[u] + units[u])]
            for i in range(0, len(order), units_per_step)]


MAX_GROUP = 126  # completions of one group: segments are int8, 0 is the prompt


def prompt_groups(pairs: list[TokenizedPair]) -> list[list[TokenizedPair]]:
    """The pairs gathered by prompt (the same token ids and, for pairs with images, the same images), in order of
    first appearance, each group in pair order."""
    groups: list[list[TokenizedPair]] = []
    by_prompt: dict[tuple[int, ...], list[list[TokenizedPair]]] = {}
    for p in pairs:
        same = by_prompt.setdefault(tuple(p.prompt), [])
        home = next((g for g in same if same_images(g[0], p)), None)
        if home is None:
            home = []
            same.append(home)
            groups.append(home)
        home.append(p)
    return groups


def same_images(a: TokenizedPair, b: TokenizedPair) -> bool:
    """Whether two pairs' prompts hold the same images (pixel for pixel; none in both counts)."""
    if a.pixel_values is None or b.pixel_values is None:
        return a.pixel_values is None and b.pixel_values is None
    grids = a.image_grid_thw is None and b.image_grid_thw is None or (
        a.image_grid_thw is not None and b.image_grid_thw is not None and torch.equal(a.image_grid_thw, b.image_grid_thw))
    return grids and a.pixel_values.shape == b.pixel_values.shape and torch.equal(a.pixel_values, b.pixel_values)


def packed_tokens(pairs: list[TokenizedPair], group: bool = False, dedupe: bool = True) -> int:
    """Tokens of the pairs in the packed layout: P + C + R each, or with `group` each prompt once and each of its
    completions once (every one of them without `dedupe`)."""
    if not group:
        return sum(p.num_tokens for p in pairs)
    total = 0
    for members in prompt_groups(pairs):
        total += len(members[0].prompt)
        if dedupe:
            total += sum(len(c) for c in {tuple(c) for p in members for c in (p.chosen, p.rejected)})
        else:
            total += sum(len(p.chosen) + len(p.rejected) for p in members)
    return total


def _units(pairs: list[TokenizedPair], max_tokens: int, group: bool, dedupe: bool) -> list[list[TokenizedPair]]:
    """What micro-batches are cut from: single pairs, or with `group` the prompt groups, a group over the budget cut
    into sub-groups that each fit (each repeats the prompt; a pair over the budget alone is its own)."""
    if not group:
        return [[p] for p in pairs]
    units = []
    for members in prompt_groups(pairs):
        part: list[TokenizedPair] = []
        for p in members:
            if part and packed_tokens(part + [p], True, dedupe) > max_tokens:
                units.append(part)
                part = []
            part.append(p)
        units.append(part)
    return units


def split_micro_batches(pairs: list[TokenizedPair], max_tokens: int, pairs_per_micro: int, group: bool = False,
                        dedupe: bool = True) -> list[list[TokenizedPair]]:
    """Group one step's pairs into micro-batches: first-fit decreasing under a token budget when `max_tokens` > 0
    (a pair longer than the budget gets its own micro-batch), else consecutive groups of `pairs_per_micro`. With
    `group`, the budget counts the packed group layout, and the pairs of one prompt stay in one micro-batch unless
    together they exceed the budget."""
    if max_tokens <= 0:
        return [pairs[i : i + pairs_per_micro] for i in range(0, len(pairs), pairs_per_micro)]
    bins: list[list[TokenizedPair]] = []
    room: list[int] = []
    units = _units(pairs, max_tokens, group, dedupe)
    for unit, size in sorted(((u, packed_tokens(u, group, dedupe)) for u in units), key=lambda us: -us[1]):
        for b, free in enumerate(room):
            if size <= free:
                bins[b].extend(unit)
                room[b] -= size
                break
        else:
            bins.append(list(unit))
            room.append(max_tokens - size)
    return bins


def _targets(start: int, plen: int, clen: int, c_start: int, first_src: int) -> tuple[list[int], list[int]]:
    """Source hidden-state indices for one completion of length clen starting at c_start (flattened indices).
    The first completion token is predicted by `first_src` (the last prompt state) unless the prompt is empty."""
    src = list(range(c_start - 1, c_start + clen - 1))
    if plen > 0:
        src[0] = first_src
        return src, list(range(clen))
    return src[1:], list(range(1, clen))  # no state predicts the first token of an unprompted completion


class _PromptTargets:
    """Prompt targets collected pair by pair: p_i predicted by the state at flattened index start + i - 1."""

    def __init__(self, num_pairs: int):
        self.src: list[int] = []
        self.tgt: list[int] = []
        self.pair: list[int] = []
        self.lengths = [0] * num_pairs

    def add(self, i: int, prompt: list[int], start: int) -> None:
        n = max(len(prompt) - 1, 0)
        self.src += range(start, start + n)
        self.tgt += prompt[1:]
        self.pair += [i] * n
        self.lengths[i] = n

    def fields(self) -> dict:
        return dict(prompt_src=int_tensor(self.src), prompt_tgt=int_tensor(self.tgt), prompt_pair=int_tensor(self.pair),
                    prompt_lengths=int_tensor(self.lengths))


def pack_pairs(pairs: list[TokenizedPair], pad_to_multiple: int = 1, pad_id: int = 0,
               prompt_targets: bool = False, group: bool = False, dedupe: bool = True) -> PairBatch:
    """Lay out pairs as [prompt | chosen | rejected] runs in one row, padded with filler up to a multiple; with
    `group`, the pairs of one prompt as one [prompt | y1 | ... | yK] run (the module docstring); with
    `prompt_targets`, the prompt tokens' targets too."""
    ids: list[int] = []
    pos: list[int] = []
    pid: list[int] = []
    seg: list[int] = []
    src: list[int] = []
    tgt: list[int] = []
    seq: list[int] = []
    b = len(pairs)
    lengths = [0] * (2 * b)
    alias = list(range(2 * b))
    prompt_alias = list(range(b))
    runs: list[tuple[int, ...]] = []
    heads: list[int] = []
    prompt = _PromptTargets(b) if prompt_targets else None
    order = {id(p): i for i, p in enumerate(pairs)}
    units = [part for members in prompt_groups(pairs) for part in _by_size(members)] if group else [[p] for p in pairs]
    for g, members in enumerate(units):
        start, plen = len(ids), len(members[0].prompt)
        ids += members[0].prompt
        pos += range(plen)
        seg += [PROMPT] * plen
        last_prompt = start + plen - 1
        first = order[id(members[0])]
        heads.append(first)
        if prompt is not None:
            prompt.add(first, members[0].prompt, start)
        held: dict[tuple[int, ...], int] = {}  # completion -> the sequence holding its targets
        run = [plen]
        for p in members:
            i = order[id(p)]
            prompt_alias[i] = first
            if prompt is not None:
                prompt.lengths[i] = prompt.lengths[first]
            for s, toks in ((i, p.chosen), (b + i, p.rejected)):
                key = tuple(toks)
                if dedupe and group and key in held:
                    alias[s], lengths[s] = held[key], lengths[held[key]]
                    continue
                held[key] = s
                c_start = len(ids)
                ids += toks
                pos += range(plen, plen + len(toks))
                seg += [len(run)] * len(toks)
                run.append(len(toks))
                s_idx, t_idx = _targets(start, plen, len(toks), c_start, last_prompt)
                src += s_idx
                tgt += [toks[t] for t in t_idx]
                seq += [s] * len(s_idx)
                lengths[s] = len(s_idx)
        pid += [g] * (len(ids) - start)
        runs.append(tuple(run))
    filler = (-len(ids)) % pad_to_multiple
    ids += [pad_id] * filler
    pos += [0] * filler
    pid += [-1] * filler
    seg += [PROMPT] * filler
    prompt_fields = prompt.fields() if prompt is not None else {}
    shared = alias != list(range(2 * b))
    return PairBatch(
        input_ids=int_tensor(ids).unsqueeze(0),
        position_ids=int_tensor(pos).unsqueeze(0),
        src=int_tensor(src),
        tgt=int_tensor(tgt),
        seq=int_tensor(seq),
        lengths=int_tensor(lengths),
        index=int_tensor([p.index for p in pairs]),
        pair_ids=int_tensor(pid, torch.int32),
        segments=int_tensor(seg, torch.int8),
        pair_lengths=tuple(runs),
        seq_alias=int_tensor(alias) if shared else None,
        prompt_alias=int_tensor(prompt_alias) if prompt is not None and prompt_alias != list(range(b)) else None,
        unit_heads=tuple(heads),
        **prompt_fields,
    )


def _by_size(members: list[TokenizedPair]) -> list[list[TokenizedPair]]:
    """A prompt's pairs in runs of at most MAX_GROUP completions (each pair adds at most two)."""
    step = MAX_GROUP // 2
    return [members[k : k + step] for k in range(0, len(members), step)]


def pad_pairs(pairs: list[TokenizedPair], pad_id: int = 0, prompt_targets: bool = False) -> PairBatch:
    """The conventional layout: 2B right-padded rows, prompt+chosen then prompt+rejected. The reference path. With
    `prompt_targets`, the prompt tokens' targets too (from the chosen rows)."""
    b = len(pairs)
    rows = [p.prompt + p.chosen for p in pairs] + [p.prompt + p.rejected for p in pairs]
    width = max(len(r) for r in rows)
    ids = torch.full((2 * b, width), pad_id, dtype=torch.long)
    mask = torch.zeros((2 * b, width), dtype=torch.long)
    src: list[int] = []
    tgt: list[int] = []
    seq: list[int] = []
    lengths = [0] * (2 * b)
    prompt = _PromptTargets(b) if prompt_targets else None
    for r, row in enumerate(rows):
        ids[r, : len(row)] = torch.tensor(row)
        mask[r, : len(row)] = 1
        p = pairs[r % b]
        if prompt is not None and r < b:
            prompt.add(r, p.prompt, r * width)
        comp = p.chosen if r < b else p.rejected
        plen = len(p.prompt)
        first = max(plen, 1)  # the first token of a row is never predicted
        for t in range(first, plen + len(comp)):
            src.append(r * width + t - 1)
            tgt.append(row[t])
            seq.append(r)
        lengths[r] = plen + len(comp) - first
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    return PairBatch(
        input_ids=ids,
        position_ids=positions,
        src=torch.tensor(src, dtype=torch.long),
        tgt=torch.tensor(tgt, dtype=torch.long),
        seq=torch.tensor(seq, dtype=torch.long),
        lengths=torch.tensor(lengths, dtype=torch.long),
        index=torch.tensor([p.index for p in pairs], dtype=torch.long),
        attention_mask=mask,
        **(prompt.fields() if prompt is not None else {}),
    )
