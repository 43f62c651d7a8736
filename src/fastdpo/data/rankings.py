"""Rankings for the listwise loss (Plackett-Luce): a record's completions in score order reach training as the
ranking's adjacent pairs (y1, y2), (y2, y3), ... (`--pairing ranking`, `fastdpo.data.groups`); a plain pair is a
ranking of two. Here the tokenised pairs are gathered back into their rankings: each pair's `chunk` names its
ranking, which steps and micro-batches keep whole."""

from __future__ import annotations

import dataclasses

from fastdpo.data.formats import Row
from fastdpo.data.pack import run_lengths
from fastdpo.data.tokenize import TokenizedPair
from fastdpo.errors import FastDPOError


def record_starts(rows: list[Row]) -> list[int]:
    """For each row, the index of its record's first row (a record's rows are adjacent, `member` 0, 1, ...)."""
    out: list[int] = []
    for i, row in enumerate(rows):
        out.append(out[-1] if i and row.member > 0 else i)
    return out


def rankings(pairs: list[TokenizedPair], rows: list[Row]) -> tuple[list[TokenizedPair], int]:
    """The pairs with `chunk` set to their ranking's number (rankings in data order), and the number of rankings
    left out because the length limits (or a bad row) dropped one of their pairs (a ranking with a gap is none). Raises
    where a record's pairs do not chain (each pair's rejected is the next pair's chosen), as a `rejected` list's
    do not."""
    starts = record_starts(rows)
    size: dict[int, int] = {}
    for s in starts:
        size[s] = size.get(s, 0) + 1
    by_record: dict[int, list[TokenizedPair]] = {}
    for p in pairs:
        by_record.setdefault(starts[p.index], []).append(p)
    out: list[TokenizedPair] = []
    left_out = number = 0
    for start in size:
        members = by_record.get(start, [])
        if len(members) != size[start]:
            left_out += not rows[start].dropped  # a record that gave no ranking at all is counted where it is read
            continue
        for a, b in zip(members, members[1:]):
            if a.rejected != b.chosen or a.prompt != b.prompt:
                raise FastDPOError(f"{rows[start].source}: its pairs are not one ranking (each pair's rejected "
                                   "completion must be the next pair's chosen), as a list of rejected replies is not: "
                                   "--loss_type plackett_luce needs rows of completions with scores or ranks, or "
                                   "plain pairs. Train these rows with a pairwise loss.")
        out += [dataclasses.replace(p, chunk=number) for p in members]
        number += 1
    return out, left_out


def ranking_sizes(pairs: list[TokenizedPair]) -> list[int]:
    """The number of pairs of each ranking, in order (consecutive pairs with the same `chunk`)."""
    return run_lengths([p.chunk for p in pairs])
