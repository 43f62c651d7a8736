"""One run trains on one kind of row: pairs (a chosen and a rejected completion of a prompt) or unpaired rows (one
completion with its label, as KTO trains on). A dataset that holds both kinds, or datasets of a run that disagree,
are refused, naming how many rows of each kind there are and where the first of each is."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from fastdpo.data.formats import Row
from fastdpo.errors import FastDPOError


@dataclass
class RowKinds:
    """Rows counted by kind, with the location (`Row.source`) of the first of each."""

    unpaired: int = 0
    pairs: int = 0
    first_unpaired: str = ""
    first_pair: str = ""

    @classmethod
    def of(cls, rows: Iterable[Row]) -> RowKinds:
        kinds = cls()
        for row in rows:
            kinds.add(row)
        return kinds

    def add(self, row: Row) -> None:
        if row.unpaired:
            self.unpaired += 1
            self.first_unpaired = self.first_unpaired or row.source
        else:
            self.pairs += 1
            self.first_pair = self.first_pair or row.source

    def merge(self, other: RowKinds) -> None:
        """Add the counts of rows read after these."""
        self.unpaired += other.unpaired
        self.pairs += other.pairs
        self.first_unpaired = self.first_unpaired or other.first_unpaired
        self.first_pair = self.first_pair or other.first_pair

    @property
    def mixed(self) -> bool:
        return bool(self.unpaired and self.pairs)

    def message(self, label: str) -> str:
        """What is mixed, where, and what to do."""
        rows = "row" if self.unpaired == 1 else "rows"
        return (f"{label}: mixes {self.unpaired} unpaired {rows} (one completion with a label; the first at "
                f"{self.first_unpaired}) with {self.pairs} pair{'s' * (self.pairs != 1)} (the first at "
                f"{self.first_pair}). A run trains on one kind: pairs with a pair loss, unpaired rows with --loss_type "
                "kto or apo_zero_unpaired. Give one kind: move the others to a dataset of their own for another run, "
                "or write each pair as two unpaired rows (its chosen completion with label true, its rejected one "
                "with label false).")


def check_row_kinds(rows: list[Row], label: str) -> None:
    """Raise a FastDPOError when `rows` (of the dataset or datasets `label` names) mix unpaired rows with pairs."""
    kinds = RowKinds.of(rows)
    if kinds.mixed:
        raise FastDPOError(kinds.message(label))
