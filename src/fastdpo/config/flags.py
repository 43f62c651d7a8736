"""Command line and YAML onto the config dataclasses: one flag per field, YAML < command line, other tools' flags
mapped through `compat`, and the resolved config written back as YAML."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import difflib
import json
import logging
import sys
from pathlib import Path
from typing import Any

import yaml

from fastdpo.config.compat import add_foreign_flags, apply_foreign, foreign_flags
from fastdpo.config.compat.noop import log_noop_notes
from fastdpo.config.fields import parse_bool, parse_dict
from fastdpo.config.launch import prints_notes
from fastdpo.config.train import TrainConfig
from fastdpo.errors import FastDPOError


def _flag_type(f: dataclasses.Field) -> Any:
    t = f.type if isinstance(f.type, str) else f.type.__name__
    t = t.replace(" | None", "")
    return {"bool": parse_bool, "int": int, "float": float, "dict": parse_dict, "list": str}.get(t, str)


class _LiteralHelp(argparse.HelpFormatter):
    """Help text printed as written: argparse would %-format it, so a literal % ("90% of the GPU") broke --help."""

    def _expand_help(self, action: argparse.Action) -> str:
        return self._get_help_string(action)


class Parser(argparse.ArgumentParser):
    """argparse that raises FastDPOError (with a close-match hint) instead of printing usage and exiting, and prints
    help texts as written."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", _LiteralHelp)
        super().__init__(*args, **kwargs)

    def parse_known_args(self, args=None, namespace=None):  # type: ignore[override]
        self._argv = list(sys.argv[1:] if args is None else args)  # for error(): which subcommand was given
        return super().parse_known_args(args, namespace)

    def error(self, message: str) -> None:  # type: ignore[override]
        hint = ""
        if "unrecognized arguments" in message:
            bad = message.split(":", 1)[1].split()[0].lstrip("-").split("=")[0]
            hint = self._flag_hint(bad)
        raise FastDPOError(f"{message}.{hint}")

    def _flag_hint(self, bad: str) -> str:
        """A close flag of the command given (the top-level parser reports its subcommand's leftovers), or the
        commands the flag belongs to."""
        subs = {name: sub for action in self._actions if isinstance(action, argparse._SubParsersAction)
                for name, sub in action.choices.items()}
        command = next((a for a in getattr(self, "_argv", []) if a in subs), None)
        parsers = [subs[command]] if command else [self, *subs.values()]
        known = {a.lstrip("-") for p in parsers for a in p._option_string_actions}
        owners = [name for name, sub in subs.items() if f"--{bad}" in sub._option_string_actions]
        if command and bad not in known and owners:
            return f" --{bad} is a flag of `fastdpo {' / '.join(owners)}`, not of `fastdpo {command}`."
        close = difflib.get_close_matches(bad, sorted(known - {bad}), n=1)
        where = f"fastdpo {command}" if command else "fastdpo COMMAND"
        return f" Did you mean --{close[0]}?" if close else f" See `{where} --help` for its flags."


def shown_default(f: dataclasses.Field) -> str:
    """A field's default as --help shows it (`default_text` in its metadata where the default depends on others)."""
    if "default_text" in f.metadata:
        return f.metadata["default_text"]
    value = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
    if isinstance(value, bool):
        return str(value).lower()
    if value in ("", [], {}):
        return "none"
    if isinstance(value, dict):
        return json.dumps(value)
    return " ".join(map(str, value)) if isinstance(value, list) else str(value)


def config_sections(cls: type) -> dict[str, list[dataclasses.Field]]:
    """The fields of a config class by section, as `--help` groups them and the CLI reference lists them: each field
    under the `title` of the section class that first declares it (a field the config class declares itself: under
    the config's own title), sections in the order their first field appears."""
    out: dict[str, list[dataclasses.Field]] = {}
    for f in dataclasses.fields(cls):
        owner = next((k for k in reversed(cls.__mro__) if f.name in k.__dict__.get("__annotations__", {})), cls)
        out.setdefault(getattr(owner, "title", "Options"), []).append(f)
    return out


def section_names(cls: type) -> dict[str, set[str]]:
    """A nested YAML file's section keys (`loss:`, `model:` ...) -> the flags each may hold."""
    out: dict[str, set[str]] = {}
    for f in dataclasses.fields(cls):
        owner = next((k for k in reversed(cls.__mro__) if f.name in k.__dict__.get("__annotations__", {})), cls)
        if getattr(owner, "name", ""):
            out.setdefault(owner.name, set()).add(f.name)
    return out


def add_config_flags(parser: argparse.ArgumentParser, cls: type = TrainConfig) -> None:
    """One flag per config field, grouped by section, with default SUPPRESS so we can tell what the user set; the
    help text ends with the field's default."""
    parser.add_argument("--config", metavar="FILE", help="YAML file with any of these flags; the command line wins.")
    for title, fields in config_sections(cls).items():
        _add_fields(parser.add_argument_group(title), fields)
    if foreign_flags(cls):
        add_foreign_flags(parser, foreign_flags(cls))


def _add_fields(parser, fields: list[dataclasses.Field]) -> None:
    for f in fields:
        text = f.metadata.get("help", "")
        kw: dict[str, Any] = {"default": argparse.SUPPRESS, "help": f"{text} [default: {shown_default(f)}]"}
        typ = _flag_type(f)
        if typ is parse_bool:
            kw.update(nargs="?", const=True, type=parse_bool, metavar="BOOL")
        elif f.metadata.get("bare"):  # also given without a value, as OpenRLHF writes --gradient_checkpointing
            kw.update(nargs="?", const=f.metadata["bare"], type=typ)
        elif f.metadata.get("nargs"):
            kw.update(nargs=f.metadata["nargs"], type=str)
        else:
            kw["type"] = typ
        parser.add_argument(f"--{f.name}", **kw)


def build_config(args: argparse.Namespace, cls: type = TrainConfig) -> Any:
    """Merge defaults < YAML file < command line into a config object (not yet validated)."""
    values: dict[str, Any] = {}
    names = {f.name: f for f in dataclasses.fields(cls)}
    foreign_names = foreign_flags(cls)
    foreign: dict[str, Any] = {}
    if getattr(args, "config", None):
        for key, value in load_yaml(args.config, names, foreign_names, cls).items():
            (foreign if key in foreign_names else values)[key] = value
    # what the user asked for: a flag on the command line, or a YAML value other than the default (a saved
    # config.yaml lists every field)
    asked = {name for name, value in values.items() if value != names[name].default}
    for name in names:
        if hasattr(args, name):
            values[name] = getattr(args, name)
            asked.add(name)
    yaml_keys = {name: args.config for name in foreign}  # before the command line's flags join them
    foreign.update({name: getattr(args, name) for name in foreign_names if hasattr(args, name)})
    yaml_keys = {name: path for name, path in yaml_keys.items() if not hasattr(args, name)}
    accumulation_given = "gradient_accumulation_steps" in values
    with _notes_once():
        apply_foreign(foreign, values, yaml_keys)  # flags of other tools' scripts and configs: mapped, noted, or refused
    if cls is TrainConfig:
        _check_adapter_flags(values, asked)
    if "gradient_checkpointing" in values:
        values["gradient_checkpointing"] = str(values["gradient_checkpointing"]).lower()
    for name in ("dataset", "val_dataset"):
        if isinstance(values.get(name), str):
            values[name] = [values[name]]
    if isinstance(values.get("target_modules"), list):
        values["target_modules"] = ",".join(map(str, values["target_modules"]))
    config = cls(**values)
    if cls is TrainConfig:
        config.step_chosen = _step_chosen(asked | set(foreign), accumulation_given, values)
        with _notes_once():
            log_noop_notes(config, asked)  # flags set that do nothing here, each said once
    return config


# the flags (fastdpo's, HF's, OpenRLHF's) that size an optimizer step
STEP_FLAGS = {"per_device_train_batch_size", "micro_train_batch_size", "gradient_accumulation_steps", "train_batch_size"}


def _step_chosen(given: set[str], accumulation_given: bool, values: dict) -> bool:
    """Whether the user sized the step: a step flag was given, and not only a micro-batch size whose accumulation a
    tool's defaults then filled in (ms-swift's 16 pairs per step)."""
    chosen = STEP_FLAGS & given
    micro_only = chosen <= {"per_device_train_batch_size", "micro_train_batch_size"}
    filled_in = not accumulation_given and "gradient_accumulation_steps" in values
    return bool(chosen) and not (micro_only and filled_in)


@contextlib.contextmanager
def _notes_once():
    """The notes about other tools' flags print once per job (`prints_notes`): other ranks, and the workers of a
    launcher that printed them already, keep only warnings and errors."""
    log = logging.getLogger("fastdpo")
    level = log.level
    if not prints_notes():
        log.setLevel(max(logging.WARNING, level))
    try:
        yield
    finally:
        log.setLevel(level)


def typed_flags(args: argparse.Namespace, fields: dict[str, tuple[str, ...]], cls: type = TrainConfig) -> dict[str, str]:
    """For each field of `fields` (field -> other tools' flags that set it), the flag as the user typed it
    (`--ulysses_num_heads 8`, on the command line or in the --config file), so errors name what was typed."""
    given: dict[str, str] = {}
    if getattr(args, "config", None):
        names = {f.name: f for f in dataclasses.fields(cls)}
        for key, value in load_yaml(args.config, names, foreign_flags(cls), cls).items():
            given[key] = f"--{key} {_shown(value)} (in {args.config})"
    given.update({name: f"--{name} {_shown(value)}" for name, value in vars(args).items()})
    out = {}
    for field, aliases in fields.items():
        name = next((n for n in (field, *aliases) if n in given), None)
        if name:
            out[field] = given[name]
    return out


def _shown(value: Any) -> str:
    return " ".join(map(str, value)) if isinstance(value, list) else str(value).lower() if isinstance(value, bool) \
        else str(value)


ADAPTER_FLAGS = ("lora_rank", "lora_alpha", "lora_dropout", "target_modules", "use_dora", "adapters", "quant_bits")


def _check_adapter_flags(values: dict, asked: set[str]) -> None:
    """Adapter settings asked for on a full fine-tune would be ignored: ms-swift scripts leave out --train_type
    because lora is its default there, while here the default is full."""
    given = [name for name in ADAPTER_FLAGS if name in asked and name in values and values[name] is not False]
    if given and values.get("train_type", "full") == "full":
        flags = ", ".join(f"--{name}" for name in given)
        raise FastDPOError(f"{flags} set, but --train_type is full (the default here; ms-swift's is lora), which "
                           "trains every weight and has no adapters to apply them to. Add --train_type lora (or qlora), "
                           "or drop them.")


def load_yaml(path: str, fields: dict[str, dataclasses.Field], extra=(), cls: type | None = None) -> dict:
    """Flag values of a YAML file, flat or nested by the sections of `cls`; `extra` names more keys that are passed
    through as they are."""
    p = Path(path)
    if not p.is_file():
        raise FastDPOError(f"Config file {path} not found. Check the path given to --config.")
    try:
        data = yaml.safe_load(p.read_text(encoding="utf-8")) or {}
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark else ""
        raise FastDPOError(f"{path}{where}: not valid YAML ({getattr(e, 'problem', e)}). Fix the syntax.") from None
    if not isinstance(data, dict):
        raise FastDPOError(f"{path}: expected a mapping of flag names to values at the top level.")
    data = _flatten_sections(path, data, fields, section_names(cls) if cls else None)
    out = {}
    for key, value in data.items():
        if key in extra:
            if value is not None:  # a key left empty (`resume_from_checkpoint: null`) asks for nothing
                out[key] = value
            continue
        if key not in fields:
            close = difflib.get_close_matches(str(key), list(fields), n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise FastDPOError(f"{path}: unknown key {key!r}.{hint}")
        typ = _flag_type(fields[key])
        if value is None:  # left unset: the default (None for e.g. greater_is_better)
            if fields[key].default is None:
                out[key] = None
            continue
        try:
            if typ is parse_bool and not isinstance(value, bool):
                value = parse_bool(value)
            elif typ in (int, float) and not isinstance(value, bool):
                value = typ(value)
            elif typ is parse_dict and isinstance(value, str):
                value = parse_dict(value)
        except (ValueError, argparse.ArgumentTypeError) as e:
            raise FastDPOError(f"{path}: key {key!r} has a bad value {value!r} ({e}).") from None
        out[key] = value
    return out


def _flatten_sections(path: str, data: dict, fields: dict[str, dataclasses.Field],
                      sections: dict[str, set[str]] | None) -> dict:
    """A YAML file nested by section (`loss: {beta: 0.1, loss_type: sigmoid}`) as flat flags; flat files pass as
    they are, and the two forms mix. A key that is both a section and a flag (`model`) is the section when its value
    is a mapping."""
    owners = sections or {}
    flat: dict = {}
    for key, value in data.items():
        if isinstance(value, dict) and key in owners and not (key in fields and _flag_type(fields[key]) is parse_dict):
            for name, inner in value.items():
                if name not in owners[key]:
                    close = difflib.get_close_matches(str(name), sorted(owners[key]), n=1)
                    hint = f" Did you mean {close[0]!r}?" if close else f" Its keys: {', '.join(sorted(owners[key]))}."
                    raise FastDPOError(f"{path}: {key}.{name} is not a flag of the {key} section.{hint}")
                if name in flat:
                    raise FastDPOError(f"{path}: {name} is given twice (at the top level and under {key}:). Keep one.")
                flat[name] = inner
        else:
            if key in flat:
                raise FastDPOError(f"{path}: {key} is given twice (at the top level and in a section). Keep one.")
            flat[key] = value
    return flat


def save_config(config: Any, path: Path) -> None:
    path.write_text(yaml.safe_dump(dataclasses.asdict(config), sort_keys=False), encoding="utf-8")
