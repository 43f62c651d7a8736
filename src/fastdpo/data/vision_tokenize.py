"""Rows with images (`fastdpo.data.vision`) as the model takes them: token ids whose prompt holds each image's run of
placeholder tokens, expanded as the model's processor expands them (Qwen2-VL: `<|vision_start|>`, then
t h w / merge_size^2 `<|image_pad|>` tokens for an image of t x h x w patches, then `<|vision_end|>`; LLaVA: the
`<image>` tag becomes the fixed run of image tokens of its image size), plus the images' `pixel_values` (and for
Qwen2-VL `image_grid_thw`) from the processor's image processor.

The processor is an argument (this floor imports no model code): a transformers processor of the Qwen2-VL or LLaVA
kind (`tokenizer`, `image_processor`, `image_token`, a chat template, and a call that takes `text` and `images`). The
conversation is rendered with its chat template (`fastdpo.data.template.ChatRenderer`: the same checks as text
rows), each `<image>` tag of the prompt as an image part. The processor is called on the rendered prompt and its
images, so the expansion is its own; the completions are what the rendered conversations add after the prompt,
tokenised without expansion (they hold no image).

Image size: `--max_pixels` / `--min_pixels` (ms-swift's names; without them ms-swift's `MAX_PIXELS` / `MIN_PIXELS`
environment variables) bound each image's resized area, passed to the image processor as its `size`
(`shortest_edge` = min pixels, `longest_edge` = max pixels); unset, the processor's own. They are Qwen2-VL's: an
image processor that resizes every image to one fixed size (LLaVA's CLIP processor) refuses them.

Length: the prompt's image tokens count toward every length limit (`fastdpo.data.tokenize.fit_length`). A prompt
is never cut through an image: a pair whose prompt would lose any token from the first image's start
(`<|vision_start|>`) on is dropped and counted (`TokenizeStats.dropped_image_cut`), never trained without it.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from fastdpo.data.formats import Row, RowError
from fastdpo.data.template import ChatRenderer
from fastdpo.data.tokenize import (
    TokenizedPair,
    TokenizeOptions,
    TokenizeStats,
    count_row,
    fit_length,
    image_count,
    merge_error,
)
from fastdpo.data.vision import IMAGE_TAG, check_images
from fastdpo.errors import FastDPOError

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class PixelOptions:
    """Bounds of each image's area after resizing, in pixels (None: the image processor's own). `from_env`: they
    come from the environment variables only, which an image processor of one fixed size (LLaVA's) ignores."""

    max_pixels: int | None = None
    min_pixels: int | None = None
    from_env: bool = field(default=False, compare=False)

    @classmethod
    def resolve(cls, max_pixels: int | None = None, min_pixels: int | None = None,
                environ: Mapping[str, str] = os.environ) -> PixelOptions:
        """The flags, else ms-swift's MAX_PIXELS / MIN_PIXELS environment variables."""
        def pick(flag: int | None, name: str) -> int | None:
            if flag is not None:
                value, where = flag, f"--{name.lower()}"
            elif environ.get(name, "").strip():
                value, where = environ[name].strip(), f"the {name} environment variable"
            else:
                return None
            try:
                number = int(value)
            except ValueError:
                raise FastDPOError(f"{where} must be a whole number of pixels, got {value!r}.") from None
            if number < 1:
                raise FastDPOError(f"{where} must be >= 1, got {number}.")
            return number

        out = cls(pick(max_pixels, "MAX_PIXELS"), pick(min_pixels, "MIN_PIXELS"),
                  from_env=max_pixels is None and min_pixels is None)
        if out.max_pixels and out.min_pixels and out.min_pixels > out.max_pixels:
            raise FastDPOError(f"min_pixels {out.min_pixels} is above max_pixels {out.max_pixels}.")
        return out

    def size(self, image_processor) -> dict | None:
        """The image processor's `size` with these bounds (None when neither is set, or when only the environment
        sets them for an image processor of one fixed size); flags for such a processor are refused."""
        if self.max_pixels is None and self.min_pixels is None:
            return None
        own = dict(getattr(image_processor, "size", None) or {})
        if own.get("longest_edge") is None:  # not an area bound: one fixed size (LLaVA's CLIP processor)
            if self.from_env:
                return None
            raise FastDPOError(f"--max_pixels / --min_pixels bound the area of Qwen2-VL's resized images, but this "
                               f"model's image processor ({type(image_processor).__name__}) resizes every image to "
                               "one fixed size. Drop them.")
        return {"shortest_edge": self.min_pixels or own.get("shortest_edge"),
                "longest_edge": self.max_pixels or own.get("longest_edge")}


@dataclass
class VisionPair:
    """One pair (or unpaired row) ready for `fastdpo.model.vlm.pack_vision_pairs`.

    pair: token ids; `pair.prompt` holds each image's placeholder run, expanded.
    pixel_values: float, the prompt's images image after image (Qwen2-VL: (patches, C * temporal_patch * patch^2)
      patches; LLaVA: (I, C, H, W) pictures); None without.
    image_grid_thw: (I, 3) long, each image's (t, h, w) patch grid in the order of its placeholders (Qwen2-VL);
      None without images or grids.
    """

    pair: TokenizedPair
    pixel_values: torch.Tensor | None = None
    image_grid_thw: torch.Tensor | None = None

    @property
    def num_images(self) -> int:
        return image_count(self.pixel_values, self.image_grid_thw)


def image_parts(messages: list[dict]) -> list[dict]:
    """Messages with `<image>` tags as content part lists (text and image parts), as chat templates of
    vision-language models take them; messages without a tag stay as they are."""
    out = []
    for m in messages:
        text = m.get("content")
        if not isinstance(text, str) or IMAGE_TAG not in text:
            out.append(m)
            continue
        parts: list[dict] = []
        for i, piece in enumerate(text.split(IMAGE_TAG)):
            if i:
                parts.append({"type": "image"})
            if piece:
                parts.append({"type": "text", "text": piece})
        out.append({**m, "content": parts})
    return out


def image_token_id(processor) -> int:
    """The id of the processor's image placeholder token."""
    token = getattr(processor, "image_token", None)
    tid = getattr(processor, "image_token_id", None)
    if tid is None and token is not None:
        tid = processor.tokenizer.convert_tokens_to_ids(token)
    if tid is None or tid == processor.tokenizer.unk_token_id:
        raise FastDPOError(f"{type(processor).__name__} has no image placeholder token: rows with images need the "
                           "processor of a vision-language model (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, LLaVA).")
    return int(tid)


def _open(row: Row) -> list:
    """The row's images, opened and loaded (the files are closed)."""
    check_images(row)
    images = []
    for ref in row.images:
        with ref.open() as im:
            im.load()
            images.append(im.copy())
    return images


def _render(renderer: ChatRenderer, row: Row) -> tuple[str, str, str]:
    return renderer.render(dataclasses.replace(row, prompt=image_parts(row.prompt)))


def vision_ids(processor, row: Row, renderer: ChatRenderer, pixels: PixelOptions = PixelOptions()
               ) -> tuple[list[int], list[int], list[int], torch.Tensor | None, torch.Tensor | None]:
    """(prompt ids with the placeholders expanded, chosen ids, rejected ids, pixel_values, image_grid_thw) of one
    conversational row; a RowError for what the row or its images get wrong."""
    if not row.conversational:
        raise RowError(row.source, "prompt", "is plain text; rows read with a vision-language processor go through "
                       "its chat template.", "Give the row as messages.", kind="plain text with a processor")
    tok = processor.tokenizer
    prompt, full_c, full_r = _render(renderer, row)
    p0, pc, pr = tok([prompt, full_c, full_r], add_special_tokens=False)["input_ids"]
    err = merge_error(tok, row.source, p0, pc, pr)
    if err is not None:
        raise err
    images = _open(row) if row.images else None
    kw = {}
    size = pixels.size(processor.image_processor)
    if images and size:
        kw["size"] = size
    enc = processor(text=[prompt], images=images, return_tensors="pt", add_special_tokens=False, **kw)
    ids = enc["input_ids"][0].tolist()
    grid = enc.get("image_grid_thw") if images else None
    if images:
        image_id = image_token_id(processor)
        if grid is not None:
            merge = int(getattr(processor.image_processor, "merge_size", 1)) ** 2
            assert ids.count(image_id) == int(grid.prod(-1).sum()) // merge, \
                "the processor expands each image pad to grid_t * grid_h * grid_w / merge_size^2 pads"
        assert len(ids) - len(p0) == ids.count(image_id) - len(images), "each image's one tag becomes its run"
    pixel_values = enc.get("pixel_values") if images else None
    return ids, pc[len(p0):], pr[len(p0):], pixel_values, grid


def _cuts_an_image(prompt: list[int], kept: int, image_id: int) -> bool:
    """A left trim of `prompt` to its last `kept` tokens removes a token of an image: one of its placeholders, or
    the token just before the first (the vision start)."""
    cut = len(prompt) - kept
    first = prompt.index(image_id) if image_id in prompt else None
    return cut > 0 and first is not None and cut >= first


def tokenize_vision_rows(processor, rows: list[Row], options: TokenizeOptions, pixels: PixelOptions = PixelOptions(),
                         start_index: int = 0, problems: list | None = None, lengths: list | None = None
                         ) -> tuple[list[VisionPair], TokenizeStats]:
    """Rows (with or without images) -> VisionPairs within the length limits, as `tokenize_chunk` does for text:
    a bad row raises its RowError, or is appended to `problems` when given; `lengths` receives (position in rows,
    prompt, chosen, rejected token counts) before the limits, image tokens included."""
    stats = TokenizeStats(rows=len(rows))
    pixels.size(processor.image_processor)  # bounds the image processor cannot take are refused before any row
    renderer = ChatRenderer(processor.tokenizer, options.template or getattr(processor, "chat_template", None),
                            options.system, options.template_timeout)
    image_id = image_token_id(processor)
    out: list[VisionPair] = []
    for k, row in enumerate(rows):
        if not count_row(row, stats):
            continue
        try:
            p, c, r, pixel_values, grid = vision_ids(processor, row, renderer, pixels)
        except RowError as e:
            if problems is None:
                raise
            problems.append(e)
            continue
        if lengths is not None:
            lengths.append((k, len(p), len(c), len(r)))
        stats.images += len(row.images)
        before = dataclasses.replace(stats)
        fitted = fit_length(p, c, r, options, stats)
        if fitted is not None and _cuts_an_image(p, len(fitted[0]), image_id):
            stats.prompt_trimmed, stats.truncated = before.prompt_trimmed, before.truncated  # not trimmed: dropped
            stats.dropped_image_cut += 1
            continue
        if fitted is None:
            continue
        stats.image_tokens += fitted[0].count(image_id)
        index = start_index + k
        if row.unpaired:
            pair = TokenizedPair(fitted[0], fitted[1], c, index, label=row.label)
        elif fitted[1] == fitted[2] and c != r:
            stats.dropped_identical_cut += 1
            continue
        else:
            pair = TokenizedPair(*fitted, index)
        out.append(VisionPair(pair, pixel_values, grid))
    stats.pairs = len(out)
    return out, stats
