"""Dataset specs -> tokenised pairs, for training or evaluation: read, validate, tokenise (cached, in parallel with
`--dataset_num_proc`), or stream (`fastdpo.data.stream`). `load_pairs` works for any spec list, so other splits
(validation sets) load the same way as the training set.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

from fastdpo.data.cache import cache_root, data_key, load_cached, save_cached
from fastdpo.data.columns import RowOptions
from fastdpo.data.formats import Row, RowError
from fastdpo.data.groups import left_out_text
from fastdpo.data.load import load_rows
from fastdpo.data.parallel import ordered_map
from fastdpo.data.rejects import REJECTS_FILE, STRICT_HINT, Rejects, row_record
from fastdpo.data.template import resolve_template
from fastdpo.data.tokenize import TokenizedPair, TokenizeOptions, TokenizeStats, no_pairs_error, tokenize_chunk
from fastdpo.data.vision_tokenize import PixelOptions, tokenize_vision_rows
from fastdpo.errors import FastDPOError

log = logging.getLogger("fastdpo")
CHUNK = 512  # rows per tokenizer call (and per task for worker processes)


@dataclass
class DataOptions:
    """How to turn dataset specs into pairs. Build it from a TrainConfig with `from_config`."""

    tokenize: TokenizeOptions = field(default_factory=TokenizeOptions)
    split: str = "train"
    seed: int = 42
    num_proc: int = 1
    use_cache: bool = True
    cache_dir: str = ""
    streaming: bool = False
    num_workers: int = 0
    shuffle_buffer_size: int = 10_000
    read: RowOptions = field(default_factory=RowOptions)  # column mapping and prompt handling
    pixels: PixelOptions = field(default_factory=PixelOptions)  # image size bounds for rows with images

    @classmethod
    def from_config(cls, cfg) -> DataOptions:
        tok = TokenizeOptions(max_length=cfg.max_length, truncation_strategy=cfg.truncation_strategy,
                              max_prompt_length=cfg.max_prompt_length, max_completion_length=cfg.max_completion_length,
                              template=resolve_template(cfg.template), system=cfg.system or None,
                              template_timeout=cfg.template_timeout)
        return cls(tok, split=cfg.split, seed=cfg.seed, num_proc=cfg.dataset_num_proc,
                   use_cache=cfg.load_from_cache_file, cache_dir=cfg.dataset_cache_dir, streaming=cfg.streaming,
                   num_workers=cfg.dataloader_num_workers,
                   shuffle_buffer_size=cfg.shuffle_buffer_size if cfg.shuffle else 1,  # a 1-pair buffer keeps the order
                   read=RowOptions.from_config(cfg),
                   pixels=PixelOptions.resolve(getattr(cfg, "max_pixels", 0) or None, getattr(cfg, "min_pixels", 0) or None))

    @classmethod
    def for_scoring(cls, cfg) -> DataOptions:
        """Tokenisation of a config that scores pairs rather than trains on them (eval, bench): its length limits
        and template, read like training's, defaults where it has no such flag; nothing cached."""
        tok = TokenizeOptions(max_length=cfg.max_length,
                              truncation_strategy=getattr(cfg, "truncation_strategy", "right"),
                              max_prompt_length=getattr(cfg, "max_prompt_length", 0),
                              max_completion_length=getattr(cfg, "max_completion_length", 0),
                              template=resolve_template(getattr(cfg, "template", "")),
                              system=getattr(cfg, "system", "") or None,
                              template_timeout=getattr(cfg, "template_timeout", TokenizeOptions.template_timeout))
        return cls(tok, seed=cfg.seed, use_cache=False, read=RowOptions.from_config(cfg),
                   pixels=PixelOptions.resolve(getattr(cfg, "max_pixels", 0) or None, getattr(cfg, "min_pixels", 0) or None))


@dataclass
class DataSummary:
    """What loading did: rows per format, pairs kept, what the length limits dropped or trimmed."""

    stats: TokenizeStats
    options: TokenizeOptions
    datasets: list[str] = field(default_factory=list)
    cached: bool = False

    def text(self) -> str:
        s, o = self.stats, self.options
        formats = ", ".join(f"{k} {v}" for k, v in sorted(s.formats.items()))
        limits = f"max_length {o.max_length}, truncation {o.truncation_strategy}"
        if o.max_prompt_length:
            limits += f", max_prompt_length {o.max_prompt_length}"
        if o.max_completion_length:
            limits += f", max_completion_length {o.max_completion_length}"
        read = f"{s.rows} rows ({formats})"
        if s.records and s.records != s.rows:  # records of several completions: each gave its pairs
            read = (f"{s.records} rows ({formats}) giving {s.rows} pairs, {s.several} of them several pairs of one "
                    "prompt")
        text = (f"data: {read} -> {s.pairs} pairs{' (from cache)' if self.cached else ''}. "
                f"{limits}: dropped {s.dropped_prompt_too_long} (prompt fills max_length), {s.dropped_too_long} "
                f"(over a length limit), {s.dropped_identical} (chosen identical to rejected)"
                + (f", {s.dropped_identical_cut} (chosen and rejected identical once cut to the length limits: they "
                   "differ only past the cut; raise --max_length or --max_completion_length to keep them)"
                   if s.dropped_identical_cut else "") + "; completions cut in "
                f"{s.truncated}, prompts trimmed in {s.prompt_trimmed}.")
        if s.left_out:
            text += f" Pairing left out (--pairing): {left_out_text(s.left_out)}."
        return text

    def to_dict(self) -> dict:
        opts = dataclasses.asdict(self.options)
        opts["template"] = opts["template"] is not None  # the Jinja text itself is noise here
        return {"datasets": self.datasets, "options": opts, "cached": self.cached, **dataclasses.asdict(self.stats)}

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(self.to_dict(), indent=2) + "\n", encoding="utf-8")

    def log(self) -> None:
        (log.warning if self.stats.dropped or self.stats.truncated or self.stats.prompt_trimmed or self.stats.left_out
         else log.info)(
            "%s", self.text())


def log_rejects(rejects: Rejects, out: Path | None) -> None:
    """When invalid rows are skipped (--strict false): how many and why, logged, and the rows written to
    `out`/rejects.jsonl (empty when none was skipped, so an earlier run's list does not linger)."""
    if not rejects.skip:
        return
    path = out / REJECTS_FILE if out is not None else None
    if path is not None:
        rejects.write(path)
    if rejects.items:
        log.warning("data: %s%s.", rejects.summary(), f" (written to {path})" if path else "")
    else:
        log.info("data: no invalid rows among %d.", rejects.rows)


def _tokenize_task(state, item) -> tuple[list[TokenizedPair], TokenizeStats, list[RowError] | None]:
    tokenizer, options, skip = state
    start, rows = item
    problems: list[RowError] | None = [] if skip else None
    pairs, stats = tokenize_chunk(tokenizer, rows, options, start, problems=problems)
    return pairs, stats, problems


def load_pairs(specs: list[str], tokenizer, opts: DataOptions) -> tuple[list[TokenizedPair], DataSummary]:
    """Every pair of the datasets `specs`, tokenised and length-limited, in dataset order (index = row position).
    Raises FastDPOError on the first bad row or when no pair survives."""
    pairs, summary = tokenize_pairs(load_rows(specs, opts.seed, opts.split, opts.read), tokenizer, opts)
    summary.datasets = list(specs)
    return pairs, summary


def tokenize_rows(rows: list[Row], tokenizer, opts: DataOptions, rejects: Rejects | None = None, processor=None
                  ) -> tuple[list[TokenizedPair], DataSummary]:
    """Rows -> pairs: with a vision-language model's `processor` and a row with images among them, every row through
    the processor (`tokenize_image_pairs`); else as text (`tokenize_pairs`). Image size bounds the processor cannot
    take are refused either way."""
    if processor is not None:
        opts.pixels.size(processor.image_processor)
    if processor is not None and any(row.images for row in rows):
        return tokenize_image_pairs(rows, processor, opts, rejects)
    return tokenize_pairs(rows, tokenizer, opts, rejects)


def tokenize_image_pairs(rows: list[Row], processor, opts: DataOptions, rejects: Rejects | None = None
                         ) -> tuple[list[TokenizedPair], DataSummary]:
    """Rows, some with images, -> pairs holding their images (`TokenizedPair.pixel_values`), index = position in
    `rows`: each conversation through the processor's chat template, each image through its image processor
    (`fastdpo.data.vision_tokenize`, --max_pixels / --min_pixels), in this process. Not cached: the cache keeps
    token ids only, and the images are read again each run."""
    skip = rejects is not None and rejects.skip
    problems: list[RowError] | None = [] if skip else None
    try:
        got, stats = tokenize_vision_rows(processor, rows, opts.tokenize, opts.pixels, problems=problems)
    except RowError as e:
        raise FastDPOError(f"{e} {STRICT_HINT}") from None
    if rejects is not None:
        rejects.rows = max(rejects.rows, len(rows))
        by_source = {r.source: r for r in rows}
        for e in problems or []:
            rejects.add(e, row_record(by_source[e.where]))
    pairs = [dataclasses.replace(v.pair, pixel_values=v.pixel_values, image_grid_thw=v.image_grid_thw) for v in got]
    if not pairs:
        raise no_pairs_error(opts.tokenize, stats)
    return pairs, DataSummary(stats, opts.tokenize)


def tokenize_pairs(rows: list[Row], tokenizer, opts: DataOptions,
                   rejects: Rejects | None = None) -> tuple[list[TokenizedPair], DataSummary]:
    """Rows -> pairs (index = position in `rows`), from the cache when the same rows were tokenised the same way
    before, else with `opts.num_proc` processes. Raises on the first row the tokenizer or chat template cannot
    handle (skipped into `rejects` when it skips them), or when no pair survives."""
    root = cache_root(opts.cache_dir)
    key = data_key(rows, tokenizer, opts.tokenize, opts.read) if opts.use_cache else None
    if key is not None:
        hit = load_cached(root, key)
        if hit is not None:
            return hit[0], DataSummary(hit[1], opts.tokenize, cached=True)
    chunks = ((start, rows[start: start + CHUNK]) for start in range(0, len(rows), CHUNK))
    workers = opts.num_proc if opts.num_proc > 1 else 0
    skip = rejects is not None and rejects.skip
    stats = TokenizeStats()
    pairs: list[TokenizedPair] = []
    skipped: list[RowError] = []
    try:
        for got, part, problems in ordered_map(_tokenize_task, chunks, (tokenizer, opts.tokenize, skip), workers):
            pairs += got
            stats.add(part)
            skipped += problems or []
    except RowError as e:
        raise FastDPOError(f"{e} {STRICT_HINT}") from None
    if rejects is not None:
        rejects.rows = max(rejects.rows, len(rows))  # rows given here without load_rows having counted them
    if skipped:
        by_source = {r.source: r for r in rows}
        for e in skipped:
            rejects.add(e, row_record(by_source[e.where]))
    if not pairs:
        raise no_pairs_error(opts.tokenize, stats)
    if key is not None and not skipped:  # skipped rows are reported each run, and a strict run must not find them gone
        try:
            save_cached(root, key, pairs, stats)
        except OSError as e:  # a read-only or full cache dir must not stop training
            log.warning("Could not write the tokenisation cache under %s (%s); going on without it (the next run "
                        "tokenises again). Free space there or choose another dir with --dataset_cache_dir.", root,
                        e.strerror or e)
    return pairs, DataSummary(stats, opts.tokenize)
