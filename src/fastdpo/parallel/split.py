"""This rank's share of a step's pairs (equal counts, balanced tokens), cut into as many micro-batches as every
other rank has, so the collectives of the micro-steps line up."""

from __future__ import annotations

from fastdpo.data.pack import packed_tokens, prompt_groups, split_micro_batches
from fastdpo.data.tokenize import TokenizedPair


def split_ranks(pairs: list[TokenizedPair], world: int, group: bool = False) -> list[list[TokenizedPair]]:
    """Deal one optimizer step's pairs to ranks: pair counts differ by at most one (equal when the step divides
    evenly), tokens balanced by giving each pair, longest first, to the rank with the fewest tokens and room left.
    With `group` a prompt's pairs are dealt together, largest group first, to the least loaded rank with room for
    all of them (a group no rank has room for is dealt pair by pair), so they share the prompt there."""
    if world == 1:
        return [list(pairs)]
    n = len(pairs)
    room = [n // world + (1 if r < n % world else 0) for r in range(world)]
    shares: list[list[TokenizedPair]] = [[] for _ in range(world)]
    load = [0] * world
    dealt: set[int] = set()
    groups = [g for g in prompt_groups(pairs) if len(g) > 1] if group else []
    for unit in sorted(groups, key=lambda g: -packed_tokens(g, True)):
        fits = [r for r in range(world) if room[r] >= len(unit)]
        if not fits:
            continue
        r = min(fits, key=lambda r: (load[r], r))
        shares[r] += unit
        load[r] += packed_tokens(unit, True)
        room[r] -= len(unit)
        dealt.update(id(p) for p in unit)
    for p in sorted((p for p in pairs if id(p) not in dealt), key=lambda p: -p.num_tokens):
        r = min((r for r in range(world) if room[r]), key=lambda r: (load[r], r))
        shares[r].append(p)
        load[r] += p.num_tokens
        room[r] -= 1
    return shares


def rank_micro_batches(pairs: list[TokenizedPair], rank: int, world: int, max_tokens: int,
                       pairs_per_micro: int, group: bool = False, dedupe: bool = True) -> list[list[TokenizedPair]]:
    """This rank's micro-batches of one step. Every rank computes every rank's plan (same seed, same pairs), so all
    agree without communicating on the number of micro-steps: a rank with fewer splits its largest micro-batches;
    one with fewer pairs than micro-steps gets empty micro-batches, which the loop runs as zero-weight forwards."""
    plans = [split_micro_batches(share, max_tokens, pairs_per_micro, group, dedupe)
             for share in split_ranks(pairs, world, group)]
    count = max(len(p) for p in plans)
    mine = plans[rank]
    while len(mine) < count:
        i = max(range(len(mine)), key=lambda j: len(mine[j]), default=-1)
        if i < 0 or len(mine[i]) < 2:
            mine.append([])
            continue
        group = mine.pop(i)
        mine[i:i] = [group[: len(group) // 2], group[len(group) // 2 :]]
    return mine


def rank_units(pairs: list[TokenizedPair], rank: int, world: int, per_micro: int = 1) -> list[list[TokenizedPair]]:
    """This rank's micro-batches of one step whose pairs come in units the loss couples (`TokenizedPair.chunk`:
    KTO's chunks of rows, Plackett-Luce's rankings), never split: `per_micro` consecutive units per micro-batch, the
    step's micro-batch k going to rank k % world as its micro-batch k // world (as TRL's sequential batches are dealt
    to ranks). Every rank runs as many micro-batches; one without units at the last gets an empty one
    (zero-weighted), so every rank joins each micro-batch's collectives."""
    units: list[list[TokenizedPair]] = []
    for p in pairs:
        if not units or units[-1][0].chunk != p.chunk:
            units.append([])
        units[-1].append(p)
    batches = [sum(units[i: i + per_micro], []) for i in range(0, len(units), per_micro)]
    rounds = -(-len(batches) // world)
    return [batches[m * world + rank] if m * world + rank < len(batches) else [] for m in range(rounds)]
