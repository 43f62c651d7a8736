"""Tokenise pairs. Plain-text rows exactly as TRL 1.x does, so log-probs are comparable on the same rows and model:
EOS text appended to each completion (unless present), then `tok(prompt)` and `tok(prompt + completion)` with the
tokenizer's own special tokens; the completion starts where the two token lists diverge.

Conversational rows go through the chat template (`fastdpo.data.template`): the rendered prompt and full
conversations are tokenised without adding special tokens (the template holds them), and the prompt's tokens must be
a prefix of the conversation's tokens (else the row is reported).

Length (`max_length` counts prompt + completion of one sequence; DESIGN §1 stores the prompt once):
- `max_prompt_length` (0: off): longer prompts lose tokens from the left (`delete`: the pair is dropped).
- `max_completion_length` (0: off): longer completions lose tokens from the right (`delete`: dropped).
- `truncation_strategy` when prompt + the longer completion exceeds `max_length`:
  `right` (default, TRL `keep_start`): completions are cut; a pair whose prompt alone fills `max_length` is dropped.
  `left`: the prompt is trimmed from the left, completions stay whole; dropped when a completion alone fills it.
  `delete`: the pair is dropped.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from fastdpo.data.formats import Row, RowError
from fastdpo.errors import FastDPOError

TRUNCATION_STRATEGIES = ("right", "left", "delete")


def image_count(pixel_values, image_grid_thw) -> int:
    """Images held by a pair's `pixel_values` / `image_grid_thw`: one grid row per image where there are grids
    (Qwen2-VL), else one picture per image (LLaVA's (I, C, H, W)); 0 without images."""
    if image_grid_thw is not None:
        return int(image_grid_thw.shape[0])
    return 0 if pixel_values is None else int(pixel_values.shape[0])


@dataclass
class TokenizedPair:
    """Token ids of one pair. `index` is the row's position in the dataset (stable across runs).

    An unpaired row (KTO) is held the same way: `chosen` is its completion, `label` its judgement (True:
    desirable), and `rejected` its KL completion once `fastdpo.data.kto.kl_completions` has set it (before, the
    completion itself, uncut by the length limits); `chunk` is the batch of rows its KL completion was taken in.

    A row with images (`fastdpo.data.vision_tokenize`) keeps them here, so that every step's grouping, ordering and
    splitting, which work on pairs, carry them along: `prompt` holds each image's placeholder run, `pixel_values`
    its images image after image (Qwen2-VL: (patches, C * temporal_patch * patch^2) patches; LLaVA: (I, C, H, W)
    pictures), `image_grid_thw` (I, 3) their (t, h, w) patch grids (Qwen2-VL; None for LLaVA); None without
    images. They count toward no token number, and such pairs are not cached (`fastdpo.data.cache` keeps token ids
    only)."""

    prompt: list[int]
    chosen: list[int]
    rejected: list[int]
    index: int
    label: bool | None = None
    chunk: int = -1
    pixel_values: object = field(default=None, compare=False, repr=False)  # torch.Tensor | None
    image_grid_thw: object = field(default=None, compare=False, repr=False)  # torch.Tensor | None

    @property
    def num_images(self) -> int:
        return image_count(self.pixel_values, self.image_grid_thw)

    @property
    def num_tokens(self) -> int:
        """Tokens in the shared layout: P + C + R."""
        return len(self.prompt) + len(self.chosen) + len(self.rejected)


@dataclass
class TokenizeOptions:
    max_length: int = 2048
    truncation_strategy: str = "right"
    max_prompt_length: int = 0
    max_completion_length: int = 0
    template: str | None = None  # Jinja text; None: the tokenizer's chat_template
    system: str | None = None
    template_timeout: float = 10.0  # seconds the chat template may take per row (0: no limit)


@dataclass
class TokenizeStats:
    rows: int = 0
    pairs: int = 0
    dropped_prompt_too_long: int = 0  # `right`: the prompt alone fills max_length
    dropped_too_long: int = 0  # `delete`: over a limit; `left`: a completion alone fills max_length
    dropped_identical: int = 0  # chosen == rejected: no preference to learn
    dropped_identical_cut: int = 0  # chosen == rejected once tokenised and cut to the length limits
    truncated: int = 0  # completions cut at the end
    prompt_trimmed: int = 0  # prompts cut from the left
    formats: dict = field(default_factory=dict)
    records: int = 0  # the records the rows came from (a record of several completions gives several rows)
    several: int = 0  # records that gave more than one pair
    dropped_no_pair: int = 0  # records of scored completions that gave no pair (every completion ties, ...)
    left_out: dict = field(default_factory=dict)  # what pairing rules left out, by reason: tied pairs, ...
    dropped_image_cut: int = 0  # rows with images whose prompt a length limit would cut through an image
    images: int = 0  # images of the tokenised rows (`fastdpo.data.vision_tokenize`)
    image_tokens: int = 0  # their placeholder tokens in the prompts kept

    def add(self, other: TokenizeStats) -> None:
        for f in fields(self):
            if f.name in ("formats", "left_out"):
                mine = getattr(self, f.name)
                for k, v in getattr(other, f.name).items():
                    mine[k] = mine.get(k, 0) + v
            else:
                setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))

    @property
    def dropped(self) -> int:
        return (self.dropped_prompt_too_long + self.dropped_too_long + self.dropped_identical + self.dropped_no_pair
                + self.dropped_identical_cut + self.dropped_image_cut)


def common_prefix_length(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def fit_length(p: list[int], c: list[int], r: list[int], o: TokenizeOptions,
               stats: TokenizeStats) -> tuple[list[int], list[int], list[int]] | None:
    """Apply the length limits to one tokenised pair; None when it is dropped (counted in `stats`)."""
    delete = o.truncation_strategy == "delete"
    trimmed = cut = False
    if o.max_prompt_length and len(p) > o.max_prompt_length:
        if delete:
            stats.dropped_too_long += 1
            return None
        p, trimmed = p[len(p) - o.max_prompt_length:], True
    if o.max_completion_length and max(len(c), len(r)) > o.max_completion_length:
        if delete:
            stats.dropped_too_long += 1
            return None
        c, r, cut = c[: o.max_completion_length], r[: o.max_completion_length], True
    longest = max(len(c), len(r))
    if len(p) + longest > o.max_length:
        if delete:
            stats.dropped_too_long += 1
            return None
        if o.truncation_strategy == "left":
            keep = o.max_length - longest
            if keep < 1:
                stats.dropped_too_long += 1
                return None
            p, trimmed = p[len(p) - keep:], True
        else:
            if len(p) >= o.max_length:
                stats.dropped_prompt_too_long += 1
                return None
            room = o.max_length - len(p)
            c, r, cut = c[:room], r[:room], True
    stats.prompt_trimmed += trimmed
    stats.truncated += cut
    return p, c, r


def _plain_ids(tokenizer, rows: list[Row]) -> list[tuple[list[int], list[int], list[int]]]:
    """TRL 1.x tokenisation of plain-text rows -> (prompt, chosen, rejected) ids."""
    eos = tokenizer.eos_token
    if eos is None:
        raise FastDPOError(
            "The tokenizer has no eos_token: completions cannot be terminated. "
            "Set eos_token in the model dir's tokenizer_config.json."
        )
    chosen = [r.chosen if r.chosen.endswith(eos) else r.chosen + eos for r in rows]
    rejected = [r.rejected if r.rejected.endswith(eos) else r.rejected + eos for r in rows]
    prompts = [r.prompt for r in rows]
    p_ids = tokenizer(prompts)["input_ids"]
    pc_ids = tokenizer([p + c for p, c in zip(prompts, chosen)])["input_ids"]
    pr_ids = tokenizer([p + r for p, r in zip(prompts, rejected)])["input_ids"]
    out = []
    for p, pc, pr in zip(p_ids, pc_ids, pr_ids):
        plen = min(common_prefix_length(p, pc), common_prefix_length(p, pr))
        out.append((pc[:plen], pc[plen:], pr[plen:]))
    return out


def _chat_ids(tokenizer, texts: list[tuple[str, str, str]], rows: list[Row]) -> list:
    """Tokenise rendered (prompt, prompt+chosen, prompt+rejected) texts; a RowError where the prompt's tokens are not a
    prefix of the conversation's (text merging across the boundary)."""
    flat = [t for triple in texts for t in triple]
    ids = tokenizer(flat, add_special_tokens=False)["input_ids"] if flat else []
    out: list = []
    for k, row in enumerate(rows):
        p, pc, pr = ids[3 * k: 3 * k + 3]
        err = merge_error(tokenizer, row.source, p, pc, pr)
        out.append(err if err is not None else (p, pc[len(p):], pr[len(p):]))
    return out


def merge_error(tokenizer, source: str, p: list[int], pc: list[int], pr: list[int]) -> RowError | None:
    """A RowError when the prompt's tokens `p` are not a prefix of the conversation's (`pc`: with chosen, `pr`:
    with rejected), the prompt's last text merging with the reply's first; None when they are."""
    bad = next((n for n, full in (("chosen", pc), ("rejected", pr)) if full[: len(p)] != p), None)
    if bad is None:
        return None
    i = common_prefix_length(p, pc if bad == "chosen" else pr)
    return RowError(source, None, f"the prompt's last tokens merge with the {bad} reply's first tokens "
                    f"({tokenizer.decode(p[i:])!r} is tokenised differently inside the conversation).",
                    "End the template's generation prompt on a token boundary (a newline or a special token).",
                    kind="prompt tokens merge with the reply")


def count_row(row: Row, stats: TokenizeStats) -> bool:
    """Count a row in `stats` (its record, format, what its pairing left out); False when it gives no pair to
    tokenise (its record gave none, or chosen is identical to rejected: counted as dropped)."""
    if row.member == 0:
        stats.records += 1
        stats.formats[row.format] = stats.formats.get(row.format, 0) + 1
        for reason, n in row.notes:
            stats.left_out[reason] = stats.left_out.get(reason, 0) + n
    elif row.member == 1:
        stats.several += 1
    if row.dropped:
        stats.dropped_no_pair += 1
        stats.left_out[row.dropped] = stats.left_out.get(row.dropped, 0) + 1
        return False
    if row.identical:
        stats.dropped_identical += 1
        return False
    return True


def tokenize_chunk(tokenizer, rows: list[Row], options: TokenizeOptions, start_index: int = 0, renderer=None,
                   problems: list | None = None, lengths: list | None = None,
                   indices: list[int] | None = None) -> tuple[list[TokenizedPair], TokenizeStats]:
    """Tokenise and length-limit one chunk of rows. Pair indices are `start_index + position in rows`, or
    `indices` (one per row) when given.
    A bad row raises its RowError, or is skipped and appended to `problems` when that list is given. `lengths`
    (if given) receives (position in rows, prompt, chosen, rejected token counts) of every tokenised row before
    length limits."""
    from fastdpo.data.template import ChatRenderer

    stats = TokenizeStats(rows=len(rows))
    keep: list[int] = []
    for k, row in enumerate(rows):
        if not count_row(row, stats):
            continue
        if options.system and not row.conversational:
            err = RowError(row.source, None, "is plain text, but --system applies to conversational rows only "
                           "(plain text is tokenised without a chat template).",
                           "Put the system text in the prompt, or give the row as messages.",
                           kind="--system on a plain-text row")
            if problems is None:
                raise err
            problems.append(err)
        else:
            keep.append(k)
    ids: dict[int, object] = {}
    plain = [k for k in keep if not rows[k].conversational]
    if plain:
        ids.update(zip(plain, _plain_ids(tokenizer, [rows[k] for k in plain])))
    chat = [k for k in keep if rows[k].conversational]
    if chat:
        renderer = renderer or ChatRenderer(tokenizer, options.template, options.system, options.template_timeout)
        texts, ok = [], []
        for k in chat:
            try:
                texts.append(renderer.render(rows[k]))
                ok.append(k)
            except RowError as e:
                ids[k] = e
        ids.update(zip(ok, _chat_ids(tokenizer, texts, [rows[k] for k in ok])))
    out: list[TokenizedPair] = []
    for k in keep:
        got = ids[k]
        if isinstance(got, tuple) and not (got[1] and got[2]):
            got = RowError(rows[k].source, None, "a completion tokenises to nothing after the prompt.",
                           "Check that chosen/rejected are not contained in the prompt.", kind="empty completion tokens")
        if isinstance(got, RowError):
            if problems is None:
                raise got
            problems.append(got)
            continue
        if lengths is not None:
            lengths.append((k, *map(len, got)))
        fitted = fit_length(*got, options, stats)
        if fitted is not None:
            index = start_index + k if indices is None else indices[k]
            if rows[k].unpaired:  # the completion, and as `rejected` the same uncut: another row's KL completion
                out.append(TokenizedPair(fitted[0], fitted[1], got[2], index, label=rows[k].label))
            elif fitted[1] == fitted[2] and got[1] != got[2]:  # they differ only past the cut: no preference left
                stats.dropped_identical_cut += 1
            else:
                out.append(TokenizedPair(*fitted, index))
    stats.pairs = len(out)
    return out, stats


def tokenize_rows(tokenizer, rows: list[Row], max_length: int | None = None, chunk: int = 512,
                  options: TokenizeOptions | None = None) -> tuple[list[TokenizedPair], TokenizeStats]:
    """Tokenise rows in batches (see the module doc for the length rules). Raises on the first bad row, or when no
    pair survives the length limits."""
    if options is None:
        options = TokenizeOptions(max_length=max_length if max_length is not None else TokenizeOptions.max_length)
    assert max_length is None or max_length == options.max_length
    stats = TokenizeStats()
    out: list[TokenizedPair] = []
    for start in range(0, len(rows), chunk):
        pairs, part = tokenize_chunk(tokenizer, rows[start: start + chunk], options, start)
        out += pairs
        stats.add(part)
    if not out:
        raise no_pairs_error(options, stats)
    return out, stats


def no_pairs_error(options: TokenizeOptions, stats: TokenizeStats) -> FastDPOError:
    if stats.rows and stats.dropped_identical == stats.rows:
        return FastDPOError("Every pair has chosen identical to rejected: there is no preference to learn.")
    return FastDPOError(f"No pair fits --max_length {options.max_length} (--truncation_strategy "
                        f"{options.truncation_strategy}): {stats.dropped} of {stats.rows} dropped. Raise --max_length.")


def check_vocab(pairs: list[TokenizedPair], rows: list[Row], vocab_size: int, model: str) -> None:
    """Raise when a token id is outside the model's input embeddings (`vocab_size` rows): the first step would fail
    with an IndexError (or a device-side assert) far from the cause. `rows[pair.index]` is each pair's row."""
    for pair in pairs:
        top = max(max(part, default=-1) for part in (pair.prompt, pair.chosen, pair.rejected))
        if top < vocab_size:
            continue
        part = next(n for n, ids in (("prompt", pair.prompt), ("chosen", pair.chosen), ("rejected", pair.rejected))
                    if ids and max(ids) == top)
        raise FastDPOError(f"{rows[pair.index].source}: token id {top} (in the {part}) is outside the vocabulary of "
                           f"the model{f' {model}' if model else ''}, whose input embeddings have {vocab_size} rows. "
                           "The tokenizer does not "
                           "match the model: load the tokenizer saved with these weights (the model dir's "
                           "tokenizer files), or, if tokens were added to the tokenizer on purpose, resize the "
                           "model's embeddings to it (model.resize_token_embeddings(len(tokenizer))) and save the "
                           "model before training.")
