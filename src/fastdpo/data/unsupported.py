"""Rows fastdpo cannot train, recognised before they would be read as something else: multimodal rows (ms-swift's and
LLaMA-Factory's `images` / `videos` / `audios` columns and `<image>` tags, TRL's vision rows with an image column or
image parts in the messages) read where images are not (a text-only model, a command that reads text) would train
as text with the media dropped. (`fastdpo train` with a vision-language model reads rows with images:
`fastdpo.data.vision`.) They are refused with what they hold and
what to do; over a whole dataset, with counts. (Unpaired rows, a completion with a label, are read: see
`fastdpo.data.formats`.)
"""

from __future__ import annotations

from fastdpo.data.formats import RowError
from fastdpo.errors import FastDPOError

# columns that hold media, and what they hold
MEDIA_COLUMNS = {"images": "images", "image": "images", "videos": "videos", "video": "videos", "audios": "audio",
                 "audio": "audio"}
# message content parts (TRL / OpenAI style) that are not text
MEDIA_PARTS = {"image": "images", "image_url": "images", "video": "videos", "video_url": "videos", "audio": "audio",
               "input_audio": "audio"}
# ms-swift's and LLaMA-Factory's placeholder of an image in the text (<video> and <audio> are HTML elements too, so
# only a media column makes those rows multimodal)
IMAGE_TAG = "<image>"
MULTIMODAL = "multimodal"
SHOWN = 3  # row locations named in a dataset's message

ADVICE = {
    MULTIMODAL: ("The model is text-only (or this command reads text only): the media would be dropped and a tag such "
                 "as <image> trained as text. Rows with images train with a vision-language model such as Qwen2.5-VL, "
                 "Qwen3-VL, Qwen2-VL or LLaVA (videos and audio are not trained), through `fastdpo train`, `eval`, "
                 "`infer` and `precompute-ref`; `tune`, `bench` and `verify --model` read text rows only. Use such a "
                 "model and "
                 "command, or remove the media columns and tags for a text-only run."),
}


class UnsupportedRow(RowError):
    """A row of a kind fastdpo does not train (`kind`: multimodal); `what` says what it holds."""

    def __init__(self, where: str, kind: str, what: str):
        super().__init__(where, None, f"{_headline(kind, what)} {ADVICE[kind]}")
        self.args = (where, kind, what)  # picklable across worker processes
        self.kind, self.what = kind, what


def _headline(kind: str, what: str) -> str:
    return f"holds {what}."


def _has(value: object) -> bool:
    return value not in (None, "", [], {}, ())


def _media_in(value: object, found: set[str], depth: int = 0) -> None:
    """Add to `found` what non-text content `value` holds: media parts of messages, <image> tags in its texts."""
    if depth > 6:
        return
    if isinstance(value, str):
        if IMAGE_TAG in value:
            found.add("<image> tags")
    elif isinstance(value, dict):
        part = value.get("type")
        if isinstance(part, str) and part in MEDIA_PARTS:
            found.add(f"{MEDIA_PARTS[part]} in the messages")
        for v in value.values():
            _media_in(v, found, depth + 1)
    elif isinstance(value, (list, tuple)):
        for v in value:
            _media_in(v, found, depth + 1)


def unsupported_kind(value: object) -> tuple[str, str] | None:
    """(kind, what it holds) when the record is one fastdpo cannot train, else None."""
    if not isinstance(value, dict):
        return None
    found = {f"the {k} column" for k in MEDIA_COLUMNS if _has(value.get(k))}
    _media_in({k: v for k, v in value.items() if k not in MEDIA_COLUMNS}, found)
    if found:
        return MULTIMODAL, ", ".join(sorted(found))
    return None


def refuse_unsupported(value: object, where: str) -> None:
    """Raise UnsupportedRow for a record fastdpo cannot train."""
    kind = unsupported_kind(value)
    if kind is not None:
        raise UnsupportedRow(where, *kind)


class UnsupportedCount:
    """Counts of unsupported rows in one dataset, by kind, with the first locations; `error()` is one message."""

    def __init__(self, label: str):
        self.label = label
        self.rows = 0
        self.found: dict[str, list[UnsupportedRow]] = {}

    def add(self, e: UnsupportedRow) -> None:
        self.found.setdefault(e.kind, []).append(e)

    def messages(self) -> list[str]:
        out = []
        for kind, errors in self.found.items():
            what = sorted({part for e in errors for part in e.what.split(", ")})
            where = ", ".join(e.where for e in errors[:SHOWN]) + (" ..." if len(errors) > SHOWN else "")
            of = f" of {self.rows}" if self.rows else ""
            out.append(f"{self.label}: {len(errors)}{of} rows are {kind} ({', '.join(what)}; {where}). {ADVICE[kind]}")
        return out

    def error(self) -> FastDPOError:
        return FastDPOError(" ".join(self.messages()))

