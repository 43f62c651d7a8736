"""Unpaired rows (KTO) prepared as TRL 1.16's KTOTrainer prepares them (design note "Preference groups", section 4):
pairs given to an unpaired loss are unpaired in TRL's order, and each row gets its KL completion, the completion of
the row before it within its batch of --per_device_train_batch_size rows (the batch's first row takes its last's).

In fastdpo's layout a row is `[prompt | completion | KL completion]`: the KL completion is the row's "rejected", so
the prompt is computed once for both and a KL completion equal to a completion of the same prompt once for all."""

from __future__ import annotations

import dataclasses

from fastdpo.data.formats import Row
from fastdpo.data.tokenize import TokenizedPair
from fastdpo.errors import FastDPOError

UNPAIR_BLOCK = 1000  # TRL unpairs with a batched `map` of this many rows: each block's chosen rows, then its rejected


def unpair_rows(rows: list[Row]) -> list[Row]:
    """Pairs as unpaired rows in TRL's order: within each block of 1000 pairs, every chosen completion (desirable),
    then every rejected one (undesirable). Unpaired rows pass through; a row left out by pairing stays, to be
    counted."""
    out: list[Row] = []
    for start in range(0, len(rows), UNPAIR_BLOCK):
        block = rows[start: start + UNPAIR_BLOCK]
        kept = [r for r in block if not r.unpaired and not r.dropped]
        out += [r for r in block if r.unpaired or r.dropped]
        out += [dataclasses.replace(r, rejected=r.chosen, label=True) for r in kept]
        out += [dataclasses.replace(r, chosen=r.rejected, label=False) for r in kept]
    return out


def check_unpaired(rows: list[Row], unpaired_loss: str | None, where: str = "--dataset") -> None:
    """Unpaired rows train only with an unpaired loss (kto, apo_zero_unpaired): raise naming the first row and what
    to do. `unpaired_loss`: the run's unpaired loss, or None when it trains on pairs."""
    first = next((r for r in rows if r.unpaired), None)
    if first is not None and unpaired_loss is None:
        count = sum(r.unpaired for r in rows)
        raise FastDPOError(f"{where}: {count} of {len(rows)} rows are unpaired (one completion with a label, e.g. "
                           f"{first.source}), but the loss trains on pairs of a chosen and a rejected completion. "
                           "Train them with --loss_type kto (or apo_zero_unpaired), or give pairs.")


def kl_completions(pairs: list[TokenizedPair], batch: int, max_length: int, max_completion_length: int = 0,
                   with_kl: bool = True) -> list[TokenizedPair]:
    """The rows in order, each with its chunk (the batch of `batch` rows it belongs to) and, as `rejected`, its KL
    completion: with `with_kl`, the completion of the row before it in its chunk (the chunk's first row takes the
    chunk's last row's; a chunk of one keeps its own), taken whole and cut to fit `max_length` after this row's
    prompt (and to `max_completion_length`), as TRL's collator cuts it; without, the row's own completion (no
    estimate is built: the layout then holds the completion once)."""
    out = []
    for start in range(0, len(pairs), batch):
        chunk = pairs[start: start + batch]
        whole = [p.rejected for p in chunk]  # each row's completion before any length limit
        for i, p in enumerate(chunk):
            kl = whole[i - 1] if with_kl else p.chosen
            if with_kl:
                if max_completion_length:
                    kl = kl[:max_completion_length]
                if max_length:
                    kl = kl[: max(max_length - len(p.prompt), 0)]
            out.append(dataclasses.replace(p, rejected=list(kl), chunk=start // batch))
    return out


def label_counts(pairs: list[TokenizedPair]) -> tuple[int, int]:
    """(desirable, undesirable) rows."""
    desirable = sum(bool(p.label) for p in pairs)
    return desirable, len(pairs) - desirable
