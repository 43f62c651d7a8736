"""What every tool's flag table is made of: a `Foreign` flag (help text and the function that gives it its meaning
here) and the small helpers those functions share."""

from __future__ import annotations

import difflib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastdpo.data.template import BUILTIN_TEMPLATES
from fastdpo.errors import FastDPOError

NLL_PER_ANSWER = ("is the mean over pairs of each chosen answer's per-token NLL; fastdpo's NLL term (--rpo_alpha, as "
                  "TRL's) is the per-token NLL over all chosen completion tokens of the step, which weighs long "
                  "answers more (ORPO's, as TRL's ORPOTrainer, also counts the chosen sequences' prompt tokens).")

Apply = Callable[[Any, dict], "str | None"]


@dataclass(frozen=True)
class Foreign:
    """A flag of another tool. `apply(value, values)` updates the config fields being built (`values`) in place and
    returns a note to log, or raises FastDPOError. `bare`: the flag may be given without a value (= true); `nargs`:
    it takes several values, as in its own tool."""

    help: str
    apply: Apply
    bare: bool = False
    nargs: str | int | None = None


@dataclass(frozen=True)
class Source:
    """The flags of one tool, shown as one group in --help. `finish(given, values)` runs after every flag's own
    `apply` when one of `markers` (default: all flags of the table) was given; it settles what depends on several
    flags and returns notes."""

    title: str
    flags: dict[str, Foreign]
    finish: Callable[[dict, dict], list[str]] | None = None
    markers: frozenset[str] | None = None

    def given_in(self, given: dict) -> bool:
        return any(name in given for name in (self.flags if self.markers is None else self.markers))


def to_bool(value: Any) -> bool:
    from fastdpo.config.fields import parse_bool

    if isinstance(value, bool):
        return value
    try:
        return parse_bool(str(value))
    except Exception:
        raise Unnamed("expected true or false.") from None


def is_off(value: Any) -> bool:
    """false / none / 0 / empty: the flag asks for nothing."""
    return value is False or value is None or str(value).strip().lower() in ("false", "0", "none", "no", "")


class Unnamed(FastDPOError):
    """An error about a flag's value raised where the flag's name is not known; `apply_foreign` puts
    `--NAME VALUE` + `sep` in front."""

    def __init__(self, message: str, sep: str = ": ") -> None:
        super().__init__(message)
        self.sep = sep


def number(value: Any, kind: type = float) -> Any:
    try:
        if isinstance(value, bool):
            raise ValueError
        x = float(value)
        if kind is int and x != int(x):
            raise ValueError
        return int(x) if kind is int else x
    except (TypeError, ValueError):
        raise Unnamed(f"expected {'an integer' if kind is int else 'a number'}.") from None


def assign(values: dict, field: str, value: Any, flag: str = "", shown: Any = None) -> None:
    """Set a config field from another tool's flag; a different value already there (a flag of fastdpo, a key of the
    same YAML or another tool's flag) is a conflict, refused."""
    if field in values and values[field] != value:
        text = f"means --{field} {value}, but --{field} is already {values[field]} (given directly or by another " \
               "flag): drop one."
        if not flag:
            raise Unnamed(text, sep=" ")
        raise FastDPOError(f"--{flag} {value if shown is None else shown} {text}")
    values[field] = value


def maps_to(field: str, kind: type = str) -> Apply:
    """The flag is another name of `field`."""
    def apply(value: Any, values: dict) -> str | None:
        if kind is bool:
            value = to_bool(value)
        elif kind in (int, float):
            value = number(value, kind)
        assign(values, field, value if kind is not str else str(value))
        return None
    return apply


def note(text: str) -> Apply:
    return lambda value, values: text


def later(value: Any, values: dict) -> str | None:
    """Settled by the tool's `finish`, together with the flags it depends on."""
    return None


def refuse_nonzero(text: str) -> Apply:
    """A no-op at 0; otherwise refused with `text`."""
    def apply(value: Any, values: dict) -> str | None:
        if number(value) == 0:
            return None
        raise FastDPOError(text.format(value=value))
    return apply


def refuse_on(text: str) -> Apply:
    """A no-op when off (false / 0 / none); otherwise refused with `text`."""
    def apply(value: Any, values: dict) -> str | None:
        if is_off(value):
            return None
        raise FastDPOError(text.format(value=value))
    return apply


def tool_template(values: dict) -> str | None:
    """--template NAME of another tool (ms-swift's and LLaMA-Factory's `qwen3`, `qwen2_5`, `glm4`, ...; names the
    tool maps to a model family's chat format): conversations render with the tokenizer's own chat template, the
    same on the command line and in YAML; the note says so. A near miss of a built-in (`chatlm`) and a missing
    file are left for the template check to refuse."""
    name = values.get("template")
    if not isinstance(name, str) or not name or name in BUILTIN_TEMPLATES or Path(name).expanduser().is_file():
        return None
    if "/" in name or "." in name or difflib.get_close_matches(name, list(BUILTIN_TEMPLATES), n=1, cutoff=0.8):
        return None
    values["template"] = ""
    return (f"--template {name}: ms-swift's and LLaMA-Factory's template names are not known here; conversations "
            "render with the tokenizer's own chat_template (the model's own format). For another layout pass "
            f"--template {'|'.join(sorted(BUILTIN_TEMPLATES))} or a Jinja file.")


def adopt(values: dict, defaults: dict) -> list[str]:
    """Set the tool's defaults that the command leaves out (fields not in `values`); name them (`--field value`)."""
    adopted = [f"--{k} {v}" for k, v in defaults.items() if k not in values]
    for k, v in defaults.items():
        values.setdefault(k, v)
    return adopted
