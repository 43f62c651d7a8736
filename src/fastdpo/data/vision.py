"""Preference rows with images, read and checked: the images travel with the row (`Row.images`, paths or encoded
bytes, never decoded pixels), in the order of their `<image>` tags in the prompt.

The three layouts users bring, each read into the text formats of `fastdpo.data.formats` with `<image>` tags where
the images go:
- ms-swift: `messages` (and `rejected_response` or `rejected_messages`) with `<image>` tags in the texts, `images` a
  list of paths or {"path", "bytes"} objects. `rejected_images` (ms-swift >= 3.8) gives the rejected conversation
  its own images: ms-swift encodes chosen and rejected as two separate inputs, so the rejected one may show other
  images. fastdpo computes the prompt once for both (DESIGN §1): `rejected_images` equal to `images` is read, any
  other is refused.
- TRL vision rows: `images` (or one `image`) plus message lists whose `content` is a list of parts
  (`{"type": "text", "text": ...}`, `{"type": "image"}`); each image part becomes an `<image>` tag.
- LLaMA-Factory sharegpt: `conversations` with `<image>` tags and the dataset_info entry's `images` column.

An image is a path (relative paths are read against the data file's directory; rows of HF datasets and in-memory
rows against the working directory), {"path", "bytes"} (HF datasets' `Image` feature undecoded; bytes win), or a
PIL image (the feature decoded; kept as PNG bytes). URLs are refused: fastdpo reads no network. Videos are
refused. Images belong to the prompt: a tag or image part in a completion is refused, and the number of tags must
equal the number of images. Rows without images may sit beside rows with them.
"""

from __future__ import annotations

import io
import os
from dataclasses import dataclass, replace
from pathlib import Path

from fastdpo.data.formats import Row, RowError

IMAGE_TAG = "<image>"
VIDEO_TAG = "<video>"
IMAGE_COLUMNS = ("images", "image")  # ms-swift / LLaMA-Factory / TRL lists, and TRL's one-image column
VIDEO_COLUMNS = ("videos", "video")
AUDIO_COLUMNS = ("audios", "audio")
MESSAGE_COLUMNS = ("prompt", "chosen", "rejected", "messages", "rejected_messages", "conversations", "completion")
URL_SCHEMES = ("http://", "https://", "ftp://", "s3://", "gs://")
VIDEO_FIX = ("videos are not trained; fastdpo reads still images only. Drop the videos (and their <video> tags), or "
             "give chosen frames as images with one <image> tag each.")
URL_FIX = "fastdpo reads no network: download the images and give their paths (relative to the data file) instead."


@dataclass(frozen=True)
class ImageRef:
    """One image of a row, not decoded: a file path (absolute once read) or the encoded image bytes."""

    path: str = ""
    data: bytes | None = None

    @property
    def label(self) -> str:
        """How messages name it: the path, or the size of the bytes."""
        return self.path or f"<{len(self.data or b'')} bytes>"

    def key(self) -> str:
        """A text that tells images apart, for duplicate pairs: the path, or a hash of the bytes."""
        if self.data is None:
            return self.path
        import hashlib

        return "sha256:" + hashlib.sha256(self.data).hexdigest()

    def open(self):
        """The image as PIL opens it (lazily: pixels are read on first use)."""
        from PIL import Image

        return Image.open(self.path if self.data is None else io.BytesIO(self.data))


def has_media(value: dict) -> bool:
    """A record read as a row with images: it holds images or videos (columns, tags, media parts in its messages),
    or messages whose content is a list of parts (the text rows of a TRL vision dataset are written so too)."""
    if any(value.get(k) not in (None, [], "") for k in IMAGE_COLUMNS + VIDEO_COLUMNS + ("rejected_images",)):
        return True
    return any(_parts_media(value.get(k)) or _part_lists(value.get(k)) for k in MESSAGE_COLUMNS)


def _part_lists(value: object) -> bool:
    """A message (or message list) whose content is a list of parts."""
    messages = value if isinstance(value, list) else [value]
    return any(isinstance(m, dict) and isinstance(m.get("content"), list) for m in messages)


def _parts_media(value: object, depth: int = 0) -> bool:
    if depth > 4:
        return False
    if isinstance(value, str):
        return IMAGE_TAG in value
    if isinstance(value, dict):
        return value.get("type") in ("image", "image_url", "video", "video_url") or any(
            _parts_media(v, depth + 1) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_parts_media(v, depth + 1) for v in value)
    return False


def _refuse_videos(value: dict, where: str) -> None:
    for name in VIDEO_COLUMNS:
        if value.get(name) not in (None, [], ""):
            raise RowError(where, name, "holds videos, but " + VIDEO_FIX, kind="videos")
    for name in AUDIO_COLUMNS:
        if value.get(name) not in (None, [], ""):
            raise RowError(where, name, "holds audio, which fastdpo does not train.", "Drop the audio column and its "
                           "<audio> tags for a text and image run.", kind="audio")


def read_image(item: object, field: str, where: str, base: Path | None) -> ImageRef:
    """One entry of an image column -> an ImageRef; a RowError for URLs, missing files and what is not an image."""
    if isinstance(item, dict):
        if item.get("bytes") is not None:
            data = item["bytes"]
            if not isinstance(data, (bytes, bytearray)):
                raise RowError(where, f"{field}.bytes", f"must be the encoded image (bytes), got "
                               f"{type(data).__name__}.", "Give the file's bytes, or its path.")
            return ImageRef(str(item.get("path") or ""), bytes(data))
        if item.get("path") is None and item.get("url") is None:
            raise RowError(where, field, f"names no image (keys: {', '.join(sorted(map(str, item))) or 'none'}).",
                           'Give a path, {"path": ...} or {"bytes": ...}.')
        item = item.get("path") or item.get("url")
    if not isinstance(item, str):
        try:
            from PIL import Image
        except ImportError:  # pragma: no cover - Pillow comes with transformers' image processing
            Image = None
        if Image is not None and isinstance(item, Image.Image):  # an HF datasets Image feature, decoded
            buffer = io.BytesIO()
            item.save(buffer, format=item.format or "PNG")
            return ImageRef(getattr(item, "filename", "") or "", buffer.getvalue())
        raise RowError(where, field, f"must be an image path, {{\"path\"}} / {{\"bytes\"}} object or PIL image, got "
                       f"{type(item).__name__}.", "Fix the row.")
    if item.lower().startswith(URL_SCHEMES):
        raise RowError(where, field, f"is a URL ({item[:80]}).", URL_FIX, kind="image URL")
    if item.startswith("data:"):
        raise RowError(where, field, "is a data URL.", "Write the image to a file and give its path, or give "
                       '{"bytes": ...}.', kind="image data URL")
    if not item:
        raise RowError(where, field, "is an empty path.", "Give the image's path.")
    path = Path(item).expanduser()
    if not path.is_absolute():
        path = (base or Path.cwd()) / path
    if not path.is_file():
        against = f" (read against {base})" if base is not None and not Path(item).is_absolute() else ""
        raise RowError(where, field, f"names an image file that does not exist: {path}{against}.",
                       "Fix the path (a relative path is read against the data file's directory), or add the file.",
                       kind="missing image")
    return ImageRef(os.path.normpath(str(path)))


def read_images(value: object, field: str, where: str, base: Path | None) -> tuple[ImageRef, ...]:
    """An image column (a list, or one image) -> its images in order."""
    if value is None:
        return ()
    items = value if isinstance(value, (list, tuple)) else [value]
    return tuple(read_image(item, f"{field}[{i}]", where, base) for i, item in enumerate(items))


def _text_content(message: object, field: str, where: str) -> object:
    """A message whose content is a list of parts -> the same message with text content, `<image>` where an image
    part was; other messages as they are."""
    if not isinstance(message, dict) or not isinstance(message.get("content"), list):
        return message
    texts = []
    for i, part in enumerate(message["content"]):
        name = f"{field}.content[{i}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text":
            texts.append(part.get("text") or "")
        elif kind == "image":
            if any(isinstance(part.get(k), str) and part[k].lower().startswith(URL_SCHEMES) for k in ("image", "url")):
                raise RowError(where, name, "is an image part with a URL.", URL_FIX, kind="image URL")
            if any(part.get(k) is not None for k in ("image", "url", "path")):
                raise RowError(where, name, "carries its image inline; fastdpo reads the images from the row's "
                               "images column, in the order of the image parts.", 'Move the image to "images" and '
                               'leave {"type": "image"} here.', kind="inline image")
            texts.append(IMAGE_TAG)
        elif kind == "image_url":
            url = part.get("image_url")
            url = url.get("url") if isinstance(url, dict) else url
            raise RowError(where, name, f"is an image_url part ({str(url)[:80]}).", URL_FIX, kind="image URL")
        elif kind in ("video", "video_url"):
            raise RowError(where, name, "is a video part, but " + VIDEO_FIX, kind="videos")
        else:
            raise RowError(where, name, f"is a part of type {kind!r}; text and image parts are read.",
                           "Give text parts ({\"type\": \"text\", \"text\": ...}) and image parts ({\"type\": "
                           "\"image\"}).")
    return {**message, "content": "".join(texts)}


def _as_text(value: object, field: str, where: str) -> object:
    """A message list (or one message) with part lists turned into text with `<image>` tags."""
    if isinstance(value, list):
        return [_text_content(m, f"{field}[{i}]", where) for i, m in enumerate(value)]
    return _text_content(value, field, where)


def split_media(value: dict, where: str, base: Path | None) -> tuple[dict, tuple[ImageRef, ...], tuple | None]:
    """A multimodal record -> (the record as text with `<image>` tags and no image columns, its images, its
    rejected_images or None). Videos, URLs and missing image files are refused here."""
    _refuse_videos(value, where)
    given = [k for k in IMAGE_COLUMNS if value.get(k) is not None]
    if len(given) > 1:
        raise RowError(where, given[1], f"is given beside {given[0]!r}.", "Keep one image column.")
    images = read_images(value.get(given[0]), given[0], where, base) if given else ()
    rejected = None
    if value.get("rejected_images") is not None:
        rejected = read_images(value["rejected_images"], "rejected_images", where, base)
    text = {k: v for k, v in value.items() if k not in IMAGE_COLUMNS + ("rejected_images",)}
    for k in MESSAGE_COLUMNS:
        if k in text:
            text[k] = _as_text(text[k], k, where)
    return text, images, rejected


def _tags(part: object) -> int:
    """`<image>` tags in a prompt or completion (text, or messages' texts)."""
    if isinstance(part, str):
        return part.count(IMAGE_TAG)
    return sum(m.get("content").count(IMAGE_TAG) for m in part if isinstance(m.get("content"), str))


def _video_tags(part: object) -> int:
    if isinstance(part, str):
        return part.count(VIDEO_TAG)
    return sum(m.get("content").count(VIDEO_TAG) for m in part if isinstance(m.get("content"), str))


def with_images(row: Row, images: tuple[ImageRef, ...], rejected: tuple | None, where: str) -> Row:
    """`row` holding `images`, checked: tags in the prompt only, as many tags as images, rejected_images equal."""
    for name in ("chosen", "rejected"):
        if _tags(getattr(row, name)):
            raise RowError(where, name, f"holds an {IMAGE_TAG} tag (or image part), but images belong to the prompt: "
                           "the completions of a pair share the prompt and its images.", "Move the image to a prompt "
                           "turn, or drop the tag from the reply.", kind="image in a completion")
    if _video_tags(row.prompt) and images:
        raise RowError(where, None, f"holds {VIDEO_TAG} tags, but " + VIDEO_FIX, kind="videos")
    if rejected is not None and rejected != images:
        raise RowError(where, "rejected_images", f"differ from images ({len(rejected)} vs {len(images)} images: "
                       f"{', '.join(i.label for i in rejected[:3])} vs {', '.join(i.label for i in images[:3])}).",
                       "fastdpo computes the prompt and its images once for chosen and rejected, so both see the same "
                       "images: drop rejected_images, or make it equal to images. (ms-swift encodes the rejected "
                       "conversation separately with its own images; fastdpo does not train pairs whose images "
                       "differ.)", kind="rejected_images differ")
    tags = _tags(row.prompt)
    if tags != len(images):
        field = "images" if images else "prompt"
        raise RowError(where, field, f"the prompt has {tags} {IMAGE_TAG} tag{'s' * (tags != 1)} (or image parts) and "
                       f"the row {len(images)} image{'s' * (len(images) != 1)}.", "Give one image per tag, in the "
                       "order of the tags.", kind="image count mismatch")
    if images and not row.conversational:
        raise RowError(where, "prompt", "is plain text, but a row with images needs messages: the chat template "
                       "places each image's placeholders in its turn.", "Give the prompt as messages (a user turn "
                       "holding the <image> tags).", kind="images in a plain-text row")
    return replace(row, images=images)


def check_image(image: ImageRef, field: str, where: str) -> tuple[int, int]:
    """Open the image and verify it; (width, height), or a RowError saying what is wrong."""
    try:
        with image.open() as im:
            size = im.size
            im.verify()
    except FileNotFoundError:
        raise RowError(where, field, f"names an image file that does not exist: {image.label}.",
                       "Fix the path, or add the file.", kind="missing image") from None
    except Exception as e:  # PIL raises many types for files that are not images
        raise RowError(where, field, f"cannot be read as an image ({image.label}: {type(e).__name__}: {e}).",
                       "Replace the file with a valid image (PNG, JPEG, ...), or drop the row.",
                       kind="unreadable image") from None
    return size


def check_images(row: Row) -> list[tuple[int, int]]:
    """Open and verify every image of a row: their (width, height); the first bad one raises its RowError."""
    return [check_image(image, f"images[{i}]", row.source) for i, image in enumerate(row.images)]
