"""`fastdpo check-data`: validate every row of the datasets and report what training would see.

Errors (non-zero exit): unreadable rows (JSON syntax, invalid UTF-8, malformed CSV), missing fields, wrong types,
empty completions, chosen identical to rejected, a label that is not true or false, unpaired rows mixed with pairs,
and with `--model` rows the chat template or tokenizer cannot handle. Rows with images (`fastdpo.data.vision`) are
read and checked: each image opened and verified, tags against images; with a vision-language `--model` their
token lengths count the images' placeholder tokens (its processor, `--max_pixels` / `--min_pixels`). Training
takes them only with a vision-language model, which the report says as a warning. Warnings: duplicate pairs, pairs
over `--max_length`. With `--model`: p50/p95/max token lengths and what the length flags would drop or trim.
Unpaired (KTO) datasets: how many rows are desirable and undesirable. Every message names the file and line (or
index), the field and a fix.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from dataclasses import dataclass, field

from fastdpo.data.formats import Row, RowError
from fastdpo.data.groups import left_out_text
from fastdpo.data.kinds import RowKinds
from fastdpo.data.prepare import DataOptions
from fastdpo.data.rejects import REJECTS_FILE, by_reason, same_problem
from fastdpo.data.sources import parse_spec, select
from fastdpo.data.tokenize import TokenizeOptions, TokenizeStats, tokenize_chunk
from fastdpo.data.unsupported import UnsupportedCount, UnsupportedRow
from fastdpo.data.vision import check_images
from fastdpo.data.vision_tokenize import tokenize_vision_rows
from fastdpo.errors import FastDPOError

CHUNK = 512
SHOWN = 50  # messages printed per list
GROUPED = 3  # more rows of a dataset with the same problem than this: one message for them all


@dataclass
class CheckReport:
    sources: list[tuple[str, int, int, dict]] = field(default_factory=list)  # (spec, rows read, rows used, formats)
    errors: list[str] = field(default_factory=list)  # in row order
    duplicates: list[str] = field(default_factory=list)
    over_length: list[str] = field(default_factory=list)
    lengths: dict = field(default_factory=lambda: {"prompt": [], "chosen": [], "rejected": []})
    stats: TokenizeStats = field(default_factory=TokenizeStats)
    notes: list[str] = field(default_factory=list)  # with a tokenizer: how the rows will be read
    longest: int = 0  # tokens of the longest pair training keeps whole (prompt + chosen + rejected)
    invalid: dict = field(default_factory=dict)  # reason -> rows training stops at (--strict false: skips)
    several: list[int] = field(default_factory=list)  # pairs of each row that gives several pairs of one prompt
    left_out: dict = field(default_factory=dict)  # what pairing left out, by reason (tied pairs, ...)
    near_prompts: list[str] = field(default_factory=list)  # prompts that differ from another only in whitespace
    labels: dict = field(default_factory=dict)  # spec -> (desirable, undesirable) unpaired rows used for training
    pair_tokens: int = 0  # with a tokenizer, rows of several pairs: tokens as one pair per row (prompt repeated)
    group_tokens: int = 0  # the same rows' tokens with each prompt and each distinct completion once
    image_rows: int = 0  # rows with images used for training
    images: int = 0  # their images, each opened and verified
    image_rows_untokenized: int = 0  # rows with images left out of the token lengths (no vision-language processor)

    @property
    def ok(self) -> bool:
        return not self.errors


def percentile(sorted_values: list[int], q: float) -> int:
    """Nearest-rank percentile of sorted values."""
    return sorted_values[max(0, math.ceil(q * len(sorted_values)) - 1)]


class _Checker:
    def __init__(self, opts: DataOptions, tokenizer, report: CheckReport, processor=None):
        self.opts, self.tokenizer, self.report, self.processor = opts, tokenizer, report, processor
        self.seen: dict[bytes, str] = {}
        self.pending: list[Row] = []
        self.vision_pending: list[Row] = []  # rows with images, tokenised by the processor
        self.errors: list[tuple[int, str]] = []  # (record ordinal, message): sorted into row order at the end
        self.ordinal = 0
        self.ordinals: dict[str, int] = {}  # source -> ordinal of the pending rows
        self.groups: dict[str, dict] = {}  # source of a row of several pairs -> its token counts so far
        self.several: set[str] = set()  # sources of the rows that give several pairs
        self.counted: set[tuple[str, int]] = set()  # (source, member) whose tokens are in `groups`
        self.spacings: dict[str, tuple[str, str]] = {}  # prompt with its whitespace collapsed -> (first text, source)
        self.spaced: set[str] = set()  # collapsed prompts already reported
        self.used: set[str] = set()  # sources of the rows checked so far
        self.flagged: set[str] = set()  # sources already reported by the tokenizer pass
        self.bad_images: set[str] = set()  # sources of rows with a missing or unreadable image

    def error(self, message: str, ordinal: int | None = None) -> None:
        self.errors.append((self.ordinal if ordinal is None else ordinal, message))

    def invalid(self, e: RowError) -> None:
        """Count a row training would stop at (or skip with --strict false), by reason."""
        self.report.invalid[e.reason] = self.report.invalid.get(e.reason, 0) + 1

    def row(self, row: Row, ordinal: int) -> None:
        """Check one row training would use; a row `#N` repeats is tokenised again but reported once."""
        repeat = (row.source, row.member) in self.used
        self.used.add((row.source, row.member))
        if row.identical:
            if not repeat:
                self.error(f"{row.source}: chosen is identical to rejected: there is no preference to learn. "
                           "Fix one of them or drop the row.", ordinal)
            return
        self._spacing(row)
        key = hashlib.blake2b(row.key().encode(), digest_size=16).digest()
        if key in self.seen and not repeat:
            self.report.duplicates.append(f"{row.source}: the same pair as {self.seen[key]}. Drop one of them.")
        self.seen.setdefault(key, row.source)
        if row.images and not self._images(row, ordinal, repeat):
            return
        if row.images and self.processor is None:
            self.report.image_rows_untokenized += not repeat
        elif self.tokenizer is not None or (row.images and self.processor is not None):
            (self.vision_pending if row.images else self.pending).append(row)
            self.ordinals[row.source] = ordinal
            if len(self.pending) >= CHUNK or len(self.vision_pending) >= CHUNK:
                self.flush()

    def _images(self, row: Row, ordinal: int, repeat: bool) -> bool:
        """Count a row's images and open each: False (the error recorded) when one is missing or unreadable."""
        if repeat:
            return row.source not in self.bad_images
        self.report.image_rows += 1
        self.report.images += len(row.images)
        try:
            check_images(row)
        except RowError as e:
            self.bad_images.add(row.source)
            self.invalid(e)
            self.error(str(e), ordinal)
            return False
        return True

    def _spacing(self, row: Row) -> None:
        """Note a prompt that differs from an earlier one only in whitespace: their tokens differ, so their pairs
        are not grouped (and are likely meant to be one prompt)."""
        text = json.dumps(row.prompt, ensure_ascii=False, sort_keys=True)
        loose = " ".join(text.replace("\\n", " ").split())
        first = self.spacings.setdefault(loose, (text, row.source))
        if first[0] != text and loose not in self.spaced:
            self.spaced.add(loose)
            self.report.near_prompts.append(f"{row.source}: the prompt of {first[1]} but for whitespace; its pairs are "
                                            "not grouped with that prompt's (their tokens differ). Write it the same "
                                            "way if it is the same prompt.")

    def _group_tokens(self, row: Row, p: int, c: int, r: int) -> None:
        """Tokens of a row of several pairs, as pairs and as one group (each prompt and distinct completion once)."""
        if row.source not in self.several or (row.source, row.member) in self.counted:
            return
        self.counted.add((row.source, row.member))
        g = self.groups.setdefault(row.source, {"pairs": 0, "prompt": 0, "completions": {}})
        g["pairs"] += p + c + r
        g["prompt"] = max(g["prompt"], p)
        for text, n in ((row.chosen, c), (row.rejected, r)):
            g["completions"][repr(text)] = n

    def group_totals(self) -> tuple[int, int]:
        as_pairs = sum(g["pairs"] for g in self.groups.values())
        return as_pairs, sum(g["prompt"] + sum(g["completions"].values()) for g in self.groups.values())

    def flush(self) -> None:
        ordinals, self.ordinals = self.ordinals, {}
        o: TokenizeOptions = self.opts.tokenize
        if self.pending:
            rows, self.pending, problems, lengths = self.pending, [], [], []
            _, stats = tokenize_chunk(self.tokenizer, rows, o, problems=problems, lengths=lengths)
            self._tokenised(rows, stats, problems, lengths, ordinals)
        if self.vision_pending:
            rows, self.vision_pending, problems, lengths = self.vision_pending, [], [], []
            _, stats = tokenize_vision_rows(self.processor, rows, o, self.opts.pixels, problems=problems,
                                            lengths=lengths)
            self._tokenised(rows, stats, problems, lengths, ordinals)

    def _tokenised(self, rows: list[Row], stats: TokenizeStats, problems: list, lengths: list, ordinals: dict) -> None:
        """Record what tokenising `rows` found: problems, lengths, pairs over --max_length."""
        o: TokenizeOptions = self.opts.tokenize
        self.report.stats.add(stats)
        for e in problems:
            if e.where not in self.flagged:
                self.flagged.add(e.where)
                self.invalid(e)
                self.error(str(e), ordinals[e.where])
        for k, p, c, r in lengths:
            self._group_tokens(rows[k], p, c, r)
            if p + max(c, r) <= o.max_length:
                self.report.longest = max(self.report.longest, p + c + r)
            self.report.lengths["prompt"].append(p)
            self.report.lengths["chosen"].append(c)
            self.report.lengths["rejected"].append(r)
            if p + max(c, r) > o.max_length and rows[k].source not in self.flagged:
                self.flagged.add(rows[k].source)
                self.report.over_length.append(f"{rows[k].source}: prompt {p} + completion {max(c, r)} tokens > "
                                               f"--max_length {o.max_length}.")


def _read(spec, opts: DataOptions, checker: _Checker) -> tuple[list[tuple[int, Row | None]], bool]:
    """Every record of one spec as (ordinal, its pairs), None for a bad row (its error recorded); and whether the
    source itself could be read."""
    from fastdpo.data.sources import iter_records

    items: list[tuple[int, list[Row] | None]] = []
    unsupported, first = UnsupportedCount(spec.label), 0  # rows of a kind fastdpo does not train: one message
    bad: dict[int, RowError] = {}  # ordinal -> the row's error; the same problem in many rows is named once
    try:
        for rec in iter_records(spec, opts.split, limit=opts.read.max_row_bytes):
            checker.ordinal += 1
            try:
                items.append((checker.ordinal, rec.rows(opts.read)))
            except UnsupportedRow as e:
                unsupported.add(e)
                checker.invalid(e)
                first = first or checker.ordinal
                items.append((checker.ordinal, None))
            except RowError as e:
                bad[checker.ordinal] = e
                checker.invalid(e)
                items.append((checker.ordinal, None))
            except FastDPOError as e:
                checker.error(str(e))
                items.append((checker.ordinal, None))
    except FastDPOError as e:  # the source itself: missing file, unreadable Parquet, unknown HF dataset
        checker.error(str(e))
        return items, False
    finally:
        unsupported.rows = len(items)
        for message in unsupported.messages():
            checker.error(message, first)
        ordinal_of = {id(e): k for k, e in bad.items()}
        for same in by_reason(list(bad.values())).values():
            if len(same) > GROUPED:
                checker.error(same_problem(same, spec.label, len(items)), ordinal_of[id(same[0])])
            else:
                for e in same:
                    checker.error(str(e), ordinal_of[id(e)])
    return items, True


def check_data(specs: list[str], opts: DataOptions, tokenizer=None, processor=None) -> CheckReport:
    """Validate every row of `specs` (all problems are collected, none raised); then check the rows training would
    use (`#N` selects them as training does), tokenising with `tokenizer` if given, and rows with images with
    `processor` (a vision-language model's) if given."""
    report = CheckReport()
    opts = dataclasses.replace(opts, read=dataclasses.replace(opts.read, images=True))  # rows with images: checked
    checker = _Checker(opts, tokenizer, report, processor)
    plain: list[Row] = []
    every = RowKinds()  # all datasets' rows: one kind for the run
    for text in specs:
        spec = parse_spec(text)
        items, readable = _read(spec, opts, checker)
        if not items and readable:
            checker.error(f"{spec.label}: has no rows. Check the file or the --split.")
        used = select(items, spec, opts.seed, opts.streaming, opts.read.max_samples)
        formats: dict[str, int] = {}
        kinds, labels, start = RowKinds(), [0, 0], None
        for ordinal, rows in used:
            if rows is None:
                continue
            start = ordinal if start is None else start
            formats[rows[0].format] = formats.get(rows[0].format, 0) + 1
            for row in rows:
                kinds.add(row)
                if row.unpaired:
                    labels[0 if row.label else 1] += 1
            if len(rows) > 1:
                report.several.append(len(rows))
                checker.several.add(rows[0].source)
            for reason, n in rows[0].notes + (((rows[0].dropped, 1),) if rows[0].dropped else ()):
                report.left_out[reason] = report.left_out.get(reason, 0) + n
            for row in rows if not rows[0].dropped else ():
                checker.row(row, ordinal)
                if not row.conversational:
                    plain.append(row)
        report.sources.append((text, len(items), len(used), formats))
        if kinds.unpaired:
            report.labels[text] = tuple(labels)
        if kinds.mixed:
            checker.error(kinds.message(spec.label), start)
        elif not every.mixed:
            every.merge(kinds)
            if every.mixed:
                checker.error(every.message(f"datasets {', '.join(specs)}"), start)
    checker.flush()
    report.pair_tokens, report.group_tokens = checker.group_totals()
    if tokenizer is not None and not opts.read.input_template:
        from fastdpo.data.template import plain_text_note

        report.notes += filter(None, [plain_text_note(plain, tokenizer, opts.tokenize.template)])
    report.errors = [m for _, m in sorted(checker.errors, key=lambda e: e[0])]
    return report


def _listing(title: str, items: list[str]) -> list[str]:
    if not items:
        return []
    out = [f"{title} ({len(items)}):"] + [f"  {m}" for m in items[:SHOWN]]
    if len(items) > SHOWN:
        out.append(f"  ... and {len(items) - SHOWN} more")
    return out


def label_line(desirable: int, undesirable: int) -> str:
    """The labels of a dataset's unpaired rows: 'unpaired rows: 30 desirable (label true), 10 undesirable (label
    false), 3.00 desirable per undesirable.'"""
    line = f"unpaired rows: {desirable} desirable (label true), {undesirable} undesirable (label false)"
    if desirable and undesirable:
        return (f"{line}, {desirable / undesirable:.2f} desirable per undesirable (KTO's paper advises "
                "desirable_weight x desirable / (undesirable_weight x undesirable) between 1 and 4/3).")
    return f"{line}: {'no undesirable' if desirable else 'no desirable'} rows, so KTO learns from one side only."


def report_lines(report: CheckReport, opts: DataOptions, model: str = "") -> list[str]:
    lines = []
    for text, n, used, formats in report.sources:
        kinds = ", ".join(f"{k} {v}" for k, v in sorted(formats.items())) or "none valid"
        count = f"{n} rows" if used == n and "#" not in text else f"{n} rows read, {used} used for training"
        lines.append(f"{text}: {count} ({kinds})")
        if text in report.labels:
            lines.append(f"  {label_line(*report.labels[text])}")
    lines += [f"note: {n}" for n in report.notes]
    if report.several:
        n, pairs = len(report.several), sum(report.several)
        lines.append(f"several completions per prompt: {n} rows give {pairs} pairs ({pairs / n:.1f} per prompt, at most "
                     f"{max(report.several)}; --pairing {opts.read.pairing.rule}).")
        if report.pair_tokens:
            saved = report.pair_tokens - report.group_tokens
            lines.append(f"  their tokens: {report.pair_tokens} written as one pair per row, {report.group_tokens} with "
                         f"each prompt and each distinct completion once ({saved} fewer, "
                         f"{saved / report.pair_tokens:.0%}).")
    if report.left_out:
        lines.append(f"left out by the pairing: {left_out_text(report.left_out)}. Tied completions are never paired; a "
                     "completion needs a score (a number) to be paired.")
    if report.invalid:
        n, rows = sum(report.invalid.values()), sum(read for _, read, _, _ in report.sources)
        counts = ", ".join(f"{k} {r}" for r, k in sorted(report.invalid.items(), key=lambda kv: -kv[1]))
        lines.append(f"invalid rows: {n} of {rows} ({counts}). Training stops at them; --strict false skips them "
                     f"and writes them to {REJECTS_FILE} in --output_dir.")
    if report.image_rows:
        lines.append(f"images: {report.image_rows} rows hold {report.images} images, each opened and verified.")
    lines += _listing("errors", report.errors)
    if report.image_rows:
        lines += _listing("warnings: rows with images", [
            f"`fastdpo train` trains the {report.image_rows} rows with images with a vision-language --model "
            "(Qwen2-VL, Qwen2.5-VL, Qwen3-VL, LLaVA) and refuses them with a text-only one; check-data reads and checks them as "
            "training will read them."])
    lines += _listing("warnings: duplicate pairs", report.duplicates)
    lines += _listing("warnings: prompts that differ only in whitespace", report.near_prompts)
    if model:
        o = opts.tokenize
        lines.append(f"token lengths under the tokenizer of {model}"
                     + (", image placeholder tokens included:" if report.stats.images else ":"))
        if report.image_rows_untokenized:
            lines.append(f"  ({report.image_rows_untokenized} rows with images left out: {model} has no "
                         "vision-language processor to count their image tokens)")
        lines.append(f"  {'':9}{'p50':>8}{'p95':>8}{'max':>8}")
        for name, values in report.lengths.items():
            v = sorted(values)
            if v:
                lines.append(f"  {name:9}{percentile(v, .5):>8}{percentile(v, .95):>8}{v[-1]:>8}")
        lines += _listing(f"warnings: pairs over --max_length {o.max_length}", report.over_length)
        s = report.stats
        lines.append(f"with --max_length {o.max_length} --truncation_strategy {o.truncation_strategy}"
                     + (f" --max_prompt_length {o.max_prompt_length}" if o.max_prompt_length else "")
                     + (f" --max_completion_length {o.max_completion_length}" if o.max_completion_length else "")
                     + f": {s.pairs} pairs kept; dropped {s.dropped_prompt_too_long} (prompt fills max_length) and "
                     f"{s.dropped_too_long} (over a length limit)"
                     + (f" and {s.dropped_image_cut} (the prompt would be cut through an image)" if s.dropped_image_cut
                        else "")
                     + f"; completions cut in {s.truncated}, prompts trimmed in {s.prompt_trimmed}.")
        if s.images:
            lines.append(f"  {s.images} images of the pairs kept hold {s.image_tokens} placeholder tokens"
                         + (f" (--max_pixels {opts.pixels.max_pixels})" if opts.pixels.max_pixels else "")
                         + (f" (--min_pixels {opts.pixels.min_pixels})" if opts.pixels.min_pixels else "") + ".")
    else:
        lines.append("token lengths: pass --model to count tokens and see what --max_length would drop.")
    n = len(report.errors)
    lines.append("OK: no errors." if report.ok else f"FAILED: {n} error{'s' if n > 1 else ''}.")
    return lines


def run_check_data(cfg, console) -> int:
    """The command: validate the data flags, check every row, print the report; 1 when there are errors."""
    cfg.validate_data()
    tokenizer = processor = None
    if cfg.model:
        from fastdpo.model.load import load_tokenizer
        from fastdpo.model.processor import is_vision_model, load_processor

        tokenizer = load_tokenizer(cfg.model, cfg.trust_remote_code)
        if is_vision_model(cfg.model, cfg.trust_remote_code):  # rows with images: their image tokens counted
            processor = load_processor(cfg.model, cfg.trust_remote_code)
    opts = DataOptions.from_config(cfg)
    ok = _check_and_print(cfg.dataset, opts, tokenizer, cfg.model, console, cfg.trust_remote_code, processor)
    if cfg.val_dataset:  # held-out pairs are read whole, from their own split
        console.print(f"held-out pairs (--val_dataset, split {cfg.val_split}):", markup=False, highlight=False)
        held_out = dataclasses.replace(opts, split=cfg.val_split, streaming=False)
        ok = _check_and_print(cfg.val_dataset, held_out, tokenizer, cfg.model, console, processor=processor) and ok
    return 0 if ok else 1


def _check_and_print(specs: list[str], opts: DataOptions, tokenizer, model: str, console,
                     trust_remote_code: bool = False, processor=None) -> bool:
    report = check_data(specs, opts, tokenizer, processor)
    lines = report_lines(report, opts, model)
    if model and report.longest:
        lines[-1:-1] = activation_lines(model, report.longest, trust_remote_code)
    for line in lines:
        console.print(line, markup=False, highlight=False, soft_wrap=True)
    return report.ok


ACTIVATION_SHARE = 0.5  # of a GPU's memory, what the estimate lets activations take (weights, optimizer: the rest)


def activation_lines(model: str, tokens: int, trust_remote_code: bool = False,
                     gpu_bytes: int | None = None) -> list[str]:
    """A rough activation estimate for the longest pair, and the --sequence_parallel_size it would need on this
    machine's GPU (`gpu_bytes`, else the first visible CUDA device's memory; none: no such line)."""
    import torch
    from transformers import AutoConfig

    from fastdpo.model.memory import activation_bytes

    try:
        config = AutoConfig.from_pretrained(model, trust_remote_code=trust_remote_code)
        plain, ckpt = (activation_bytes(config, tokens, c) for c in (False, True))
    except Exception:  # a tokenizer without a model config: no estimate
        return []
    gib = 2**30
    lines = [f"activations of the longest pair ({tokens} tokens), roughly, in bf16: {plain / gib:.1f} GiB without "
             f"gradient checkpointing, {ckpt / gib:.1f} GiB with --gradient_checkpointing full; "
             "--sequence_parallel_size N gives each GPU about 1/N of them."]
    if gpu_bytes is None and torch.cuda.is_available():
        gpu_bytes = torch.cuda.get_device_properties(0).total_memory
    if gpu_bytes:
        room = ACTIVATION_SHARE * gpu_bytes
        n = 1
        while ckpt / n > room and n < 1024:
            n *= 2
        where = f"on a GPU of {gpu_bytes / gib:.0f} GiB (activations within {ACTIVATION_SHARE:.0%} of it)"
        lines.append(f"  {where}: the longest pair fits on one GPU with --gradient_checkpointing full." if n == 1
                     else f"  {where}: the longest pair needs --sequence_parallel_size {n} with "
                          "--gradient_checkpointing full.")
    return lines
