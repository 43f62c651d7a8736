"""mkdocs hook: the CLI reference page, rendered at build time from the real command-line parsers.

`fastdpo.cli.build_parser()` is walked as `fastdpo --help` would be: one section per subcommand, and within it one
part per argument group (the config sections, `fastdpo.config.sections`, then the flags accepted from other
tools), each flag with its value, default and help text. A group that a command shares with one listed before it
(`check-data` takes every flag of `train`) is linked, not repeated. So the page lists exactly the flags each command
accepts and cannot drift from them. Flags are HTML definition lists; `.cli-flag` names, and one-word code spans
marked `.cli-word`, never wrap (`docs/stylesheets/cli.css`).
"""

from __future__ import annotations

import argparse
import html
import importlib
import re
import sys
from pathlib import Path

MARKER = "<!-- cli-reference -->"
PAGE = "reference/cli.md"

# where each command is explained at length (relative to the reference page)
GUIDES = {
    "train": ("Training", "../guides/training.md"),
    "check-data": ("Data", "../guides/data.md#checking-data-before-training"),
    "precompute-ref": ("Losses and references", "../guides/losses.md#the-reference"),
    "bench": ("Performance", "../guides/performance.md#measuring"),
    "tune": ("Performance", "../guides/performance.md#memory"),
    "verify": ("Monitoring", "../guides/monitoring.md#tools"),
    "infer": ("After training", "../guides/after-training.md"),
    "eval": ("After training", "../guides/after-training.md"),
    "export": ("After training", "../guides/after-training.md"),
    "demo": ("Getting started", "../getting-started.md#the-demo"),
}
VALUE_NAMES = {int: "INT", float: "FLOAT"}


def _parser() -> argparse.ArgumentParser:
    src = Path(__file__).resolve().parents[2] / "src"
    if src.is_dir() and str(src) not in sys.path:
        sys.path.insert(0, str(src))  # the working tree's parsers, installed or not
    return importlib.import_module("fastdpo.cli").build_parser()


def commands(parser: argparse.ArgumentParser) -> dict[str, tuple[str, argparse.ArgumentParser]]:
    """Subcommand name -> (its one-line help, its parser), in `fastdpo --help` order."""
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    helps = {a.dest: a.help or "" for a in sub._choices_actions}
    return {name: (helps.get(name, ""), p) for name, p in sub.choices.items()}


def groups(name: str, parser: argparse.ArgumentParser) -> list[tuple[str, str, list[argparse.Action]]]:
    """(heading, anchor, actions) of each argument group of a command that has any, --help left out."""
    out = []
    for group in parser._action_groups:
        actions = [a for a in group._group_actions if not isinstance(a, argparse._HelpAction)]
        if not actions:
            continue
        if group is parser._optionals:  # the command's own flags: "General" next to config sections
            title = "General" if len(parser._action_groups) > 2 else "Flags"
        elif group is parser._positionals:
            title = "Arguments"
        else:
            title = group.title[:1].upper() + group.title[1:]
        out.append((title, f"{name}-{_slug(title)}", actions))
    return out


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def _text(text: str) -> str:
    """Help text as HTML: escaped, with `code` spans."""
    pieces = html.escape(" ".join(text.split()), quote=False).split("`")
    return "".join(f"<code>{p}</code>" if i % 2 else p for i, p in enumerate(pieces))


def _split_default(action: argparse.Action) -> tuple[str, str]:
    """(help, default): the config flags' help ends with `[default: X]`; other flags' default is their own."""
    text = action.help or ""
    m = re.search(r"\s*\[default: (.*)\]$", text, flags=re.S)
    if m:
        return text[: m.start()], m.group(1)
    value = action.default
    if value in (None, argparse.SUPPRESS, False, "", []) or action.nargs == 0:
        return text, ""
    return text, " ".join(map(str, value)) if isinstance(value, list) else str(value)


def _value(action: argparse.Action) -> str:
    """The value a flag takes, as usage shows it (empty for a switch)."""
    if action.nargs == 0:
        return ""
    if action.choices and not action.metavar:
        one = "|".join(map(str, action.choices))
    elif action.metavar:
        one = "true|false" if action.metavar == "BOOL" else str(action.metavar)
    elif not action.option_strings:
        one = action.dest.upper()
    else:
        one = VALUE_NAMES.get(action.type, "JSON" if getattr(action.type, "__name__", "") == "_parse_dict" else "VALUE")
    return {"?": f"[{one}]", "+": f"{one} …", "*": f"[{one} …]"}.get(action.nargs, one)


def _item(anchor: str, action: argparse.Action) -> str:
    name = action.option_strings[-1] if action.option_strings else action.dest.upper()
    text, default = _split_default(action)
    value = _value(action) if action.option_strings else ""
    dt = f'<code class="cli-flag">{html.escape(name)}</code>'
    if value:
        dt += f' <code class="cli-value">{html.escape(value)}</code>'
    if default:
        dt += f' <span class="cli-default">default: {_text(default if "`" in default else f"`{default}`")}</span>'
    if action.required:
        dt += ' <span class="cli-default">required</span>'
    key = name.lstrip("-")
    return f'<dt id="{anchor}-{key}">{dt}</dt><dd>{_text(text)}</dd>'


def _dl(anchor: str, actions: list[argparse.Action]) -> str:
    return '<dl class="cli-flags">\n' + "\n".join(_item(anchor, a) for a in actions) + "\n</dl>\n"


def _key(actions: list[argparse.Action]) -> tuple:
    return tuple((tuple(a.option_strings), a.help, a.nargs) for a in actions)


def render(parser: argparse.ArgumentParser | None = None) -> str:
    parser = parser or _parser()
    cmds = commands(parser)
    parts = ["| command | what it does |", "|---|---|"]
    parts += [f"| [`{name}`](#{name}) | {help.rstrip('.')} |" for name, (help, _) in cmds.items()]
    parts.append("")
    first: dict[tuple, tuple[str, str, str]] = {}  # a group's flags -> (command, heading, anchor) listing them
    for name, (help, p) in cmds.items():
        own, shared = [], []
        for title, anchor, actions in groups(name, p):
            key = (title, _key(actions))
            if key in first and title not in ("General", "Flags"):  # a command's own few flags are listed with it
                shared.append(first[key])
            else:
                first[key] = (name, title, anchor)
                own.append((title, anchor, actions))
        guide = f" More in [{GUIDES[name][0]}]({GUIDES[name][1]})." if name in GUIDES else ""
        parts.append(f"## {name} {{#{name}}}\n\n`fastdpo {name}`: {help}{guide}\n")
        for by in dict.fromkeys(cmd for cmd, _, _ in shared):
            links = ", ".join(f"[{title}](#{anchor})" for cmd, title, anchor in shared if cmd == by)
            parts.append(f"Takes every flag of [`fastdpo {by}`](#{by}) in: {links}.\n")
        for title, anchor, actions in own:
            parts.append(f"### {title} {{#{anchor}}}\n\n{_dl(anchor, actions)}")
    return "\n".join(parts)


def on_page_markdown(markdown: str, page, config, files) -> str:
    if page.file.src_uri != PAGE:
        return markdown
    if MARKER not in markdown:
        raise ValueError(f"{PAGE} lost its marker {MARKER!r}: the CLI reference has nowhere to go.")
    return markdown.replace(MARKER, render())


def on_page_content(html_text: str, page, config, files) -> str:
    """On the reference page, a one-word code span (`--config`, `precompute-ref`) never wraps either: the theme lets
    code break anywhere, even after the `--` of a flag."""
    if page.file.src_uri != PAGE:
        return html_text
    return re.sub(r"<code>([^<\s]+)</code>", r'<code class="cli-word">\1</code>', html_text)


if __name__ == "__main__":  # print the generated Markdown: python docs/hooks/cli_reference.py
    print(render())
