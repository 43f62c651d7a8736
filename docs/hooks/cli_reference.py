"""mkdocs hook: the CLI reference page, rendered at build time from the config dataclasses' field metadata.

Every flag of `fastdpo train` (and of `eval`, `infer`, `export` when their configs are exported by `fastdpo.config`) is
a dataclass field whose metadata holds its help text (`_f(default, help, **kw)` in the config schema). This hook
replaces the marker in `reference/cli.md` with one table per config, so the flags and their documentation cannot
drift apart. Only `fastdpo.config` is imported.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import sys
from pathlib import Path

MARKER = "<!-- cli-reference -->"
PAGE = "reference/cli.md"

# (class name in fastdpo.config, heading, the commands that take these flags); a class that fastdpo.config does not
# export is skipped
CONFIGS = (
    ("TrainConfig", "Training flags", "`fastdpo train`, and the same flags for `check-data`, `precompute-ref`, "
     "`bench`, `tune` (see each command's `--help` for its own additions)"),
    ("EvalConfig", "Evaluation flags", "`fastdpo eval`"),
    ("InferConfig", "Generation flags", "`fastdpo infer`"),
    ("ExportConfig", "Export flags", "`fastdpo export`"),
)


def _config_module():
    src = Path(__file__).resolve().parents[2] / "src"
    if src.is_dir() and str(src) not in sys.path:
        sys.path.insert(0, str(src))  # the working tree's flags, installed or not
    return importlib.import_module("fastdpo.config")


def _cell(text: str) -> str:
    """Text safe inside a Markdown table cell: outside code spans, pipes, asterisks and `<` escaped; inside them (odd
    pieces when split at backticks) the table extension leaves pipes alone, and an escape would show."""
    pieces = text.replace("\n", " ").split("`")
    for i in range(0, len(pieces), 2):
        pieces[i] = pieces[i].replace("\\", "\\\\").replace("|", "\\|").replace("*", "\\*").replace("<", "&lt;")
    return "`".join(pieces)


def _type(f: dataclasses.Field) -> str:
    t = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
    if f.metadata.get("nargs") == "+":
        t = f"{t} (one or more values)"
    return t


def _default(f: dataclasses.Field) -> str:
    if "default_text" in f.metadata:  # a default that depends on other flags
        return _cell(f.metadata["default_text"])
    if f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        value = f.default_factory()  # type: ignore[misc]
    else:
        return "required"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if value == "":
        return '`""`'
    if isinstance(value, (list, dict)):
        return f"`{json.dumps(value)}`"
    return f"`{value}`"


def _flag(f: dataclasses.Field) -> str:
    bare = f.metadata.get("bare")
    typ = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", "")
    if typ == "bool":
        return f"`--{f.name}`<br>`--{f.name} true|false`"
    if bare:
        return f"`--{f.name}`<br>`--{f.name} VALUE`"
    return f"`--{f.name}`"


def render_table(cls: type) -> str:
    rows = ["| flag | type | default | meaning |", "|---|---|---|---|"]
    for f in dataclasses.fields(cls):
        meaning = _cell(f.metadata.get("help", ""))
        if f.metadata.get("bare"):
            meaning += f" Given bare: `{f.metadata['bare']}`."
        rows.append(f"| {_flag(f)} | {_cell(_type(f))} | {_default(f)} | {meaning} |")
    return "\n".join(rows)


def render() -> str:
    module = _config_module()
    parts = []
    for name, heading, commands in CONFIGS:
        cls = getattr(module, name, None)
        if cls is None or not dataclasses.is_dataclass(cls):
            continue
        count = len(dataclasses.fields(cls))
        parts.append(f"## {heading}\n\nTaken by {commands}; {count} flags, from `fastdpo.config.{name}`.\n\n"
                     f"{render_table(cls)}\n")
    return "\n".join(parts)


def on_page_markdown(markdown: str, page, config, files) -> str:
    if page.file.src_uri != PAGE:
        return markdown
    if MARKER not in markdown:
        raise ValueError(f"{PAGE} lost its marker {MARKER!r}: the CLI reference has nowhere to go.")
    return markdown.replace(MARKER, render())


if __name__ == "__main__":  # print the generated Markdown: python docs/hooks/cli_reference.py
    print(render())
