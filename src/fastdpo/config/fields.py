"""What every config section is built from: one `option` per flag (default, help text), the `Section` each config
class groups its flags under, and the value parsers and checks that the flags, YAML files and sections share."""

from __future__ import annotations

import argparse
import dataclasses
import json
from typing import Any, ClassVar

from fastdpo.errors import FastDPOError


class Section:
    """A group of flags that belong together (the model, the loss, ...). `name` is its key in a nested YAML file
    (`loss: {beta: 0.1}`) and in `TrainConfig.sections()`; `title` heads its group in `--help` and the CLI reference.
    A section validates its own flags (`validate_<name>`); checks across sections belong to the config that joins
    them."""

    name: ClassVar[str] = ""
    title: ClassVar[str] = "Options"

    @classmethod
    def own_fields(cls) -> list[str]:
        """The flags this class declares itself (not those of the sections it extends)."""
        return [n for n in cls.__dict__.get("__annotations__", {}) if n in {f.name for f in dataclasses.fields(cls)}]


def option(default: Any, help: str, **kw: Any) -> Any:
    """A flag: its default and help text; `nargs`, `bare` (the value of the flag given alone) and `default_text`
    (the default as --help shows it) in `kw`."""
    if isinstance(default, (list, dict)):
        return dataclasses.field(default_factory=lambda: type(default)(default), metadata={"help": help, **kw})
    return dataclasses.field(default=default, metadata={"help": help, **kw})


def check_choice(name: str, value: str, choices: tuple) -> None:
    if value not in choices:
        raise FastDPOError(f"--{name} {value!r} is not one of: {', '.join(choices)}.")


def at_least(cfg: Any, bound: int | float, *names: str, hint: str = "") -> None:
    """Each named flag of `cfg` is >= `bound`."""
    for name in names:
        if getattr(cfg, name) < bound:
            raise FastDPOError(f"--{name} must be >= {bound}{hint}, got {getattr(cfg, name)}.")


def parse_bool(text: str) -> bool:
    t = str(text).strip().lower()
    if t in ("true", "1", "yes", "on"):
        return True
    if t in ("false", "0", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def parse_dict(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r} ({e.msg})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value
