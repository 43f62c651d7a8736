"""Streaming: pairs read and tokenised lazily, for datasets larger than memory (`--streaming`, needs `--max_steps`).

Records are read in order (datasets interleaved row by row), tokenised in chunks by `--dataloader_num_workers`
worker processes (0: in this process) with a bounded look-ahead, then shuffled through a seeded buffer of
`--shuffle_buffer_size` pairs. The stream cycles: epoch e reshuffles with seed and e. The order depends only on the
data, the seed and the buffer size (never on the number of workers), so resuming replays it exactly.
With streaming, `path#N` takes the first N rows of that dataset, cycling when it is shorter.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

from fastdpo.data.kinds import RowKinds
from fastdpo.data.parallel import ordered_map
from fastdpo.data.prepare import DataOptions, DataSummary
from fastdpo.data.sources import Record, Spec, first_cycling, iter_records, parse_spec, source_kind
from fastdpo.data.tokenize import TokenizedPair, TokenizeStats, no_pairs_error, tokenize_chunk
from fastdpo.errors import FastDPOError

CHUNK = 1024  # records per worker task


def _stream_task(state, item) -> tuple[list[TokenizedPair], TokenizeStats, RowKinds]:
    tokenizer, options, read = state
    start, records = item
    rows, indices = [], []
    for k, record in enumerate(records):
        pairs = record.rows(read)
        rows += pairs
        indices += [start + k] * len(pairs)  # a stream's pairs are indexed by their record
    return *tokenize_chunk(tokenizer, rows, options, indices=indices), RowKinds.of(rows)


class PairStream:
    """An endless iterator of tokenised pairs over `specs`; `stats` counts what has been read so far."""

    def __init__(self, specs: list[str], tokenizer, opts: DataOptions):
        self.specs: list[Spec] = [parse_spec(s) for s in specs]
        for spec in self.specs:
            source_kind(spec)  # a missing path fails now, not at the first step
        self.tokenizer = tokenizer
        self.opts = opts
        self.stats = TokenizeStats()
        self.epoch = 0
        self.kinds = RowKinds()  # the rows read so far: one kind (pairs or unpaired rows) for the whole stream
        self._it = self._pairs()

    def _limited(self, spec: Spec) -> Iterator[Record]:
        def read() -> Iterator[Record]:
            return iter_records(spec, self.opts.split, streaming=True, limit=self.opts.read.max_row_bytes)

        if spec.count is None:
            return read()
        return first_cycling(read, spec.count, spec.label)

    def records(self) -> Iterator[Record]:
        """One pass over the datasets, interleaved row by row."""
        live = [self._limited(s) for s in self.specs]
        while live:
            for it in list(live):
                rec = next(it, None)
                if rec is None:
                    live.remove(it)
                else:
                    yield rec

    def _chunks(self) -> Iterator[tuple[int, list[Record]]]:
        buf: list[Record] = []
        start = 0
        for rec in self.records():
            buf.append(rec)
            if len(buf) == CHUNK:
                yield start, buf
                start, buf = start + CHUNK, []
        if buf:
            yield start, buf

    def _pairs(self) -> Iterator[TokenizedPair]:
        size = max(1, self.opts.shuffle_buffer_size)
        state = (self.tokenizer, self.opts.tokenize, self.opts.read)
        while True:
            rng = random.Random(self.opts.seed * 1_000_003 + self.epoch)
            buffer: list[TokenizedPair] = []
            for pairs, part, kinds in ordered_map(_stream_task, self._chunks(), state, self.opts.num_workers):
                if self.epoch == 0:  # later epochs repeat the same rows
                    self.stats.add(part)
                    self.kinds.merge(kinds)
                    if self.kinds.mixed:
                        raise FastDPOError(self.kinds.message(", ".join(s.text for s in self.specs)))
                for p in pairs:
                    if len(buffer) < size:
                        buffer.append(p)
                        continue
                    j = rng.randrange(size)
                    yield buffer[j]
                    buffer[j] = p
            if not self.stats.pairs:
                raise no_pairs_error(self.opts.tokenize, self.stats)
            rng.shuffle(buffer)
            yield from buffer
            self.epoch += 1

    def take(self, n: int) -> list[TokenizedPair]:
        return [next(self._it) for _ in range(n)]

    def skip(self, n: int) -> None:
        for _ in range(n):
            next(self._it)

    def summary(self) -> DataSummary:
        return DataSummary(self.stats, self.opts.tokenize, [s.text for s in self.specs])

    def close(self) -> None:
        self._it.close()
