"""Flags of other tools' scripts and configs (ms-swift, HF TrainingArguments, TRL, LLaMA-Factory, OpenRLHF) that
have no field of their own here. Each is accepted on the command line and in YAML and given its meaning here:
mapped onto a config field, a no-op with a logged note when fastdpo already behaves that way, or a clear error
when honouring it is impossible (a copied command must never train something other than what it asks for without
saying so). One module per tool holds its table; this one joins them."""

from __future__ import annotations

import argparse
import dataclasses
import logging

from fastdpo.config.compat.base import Foreign, Source, Unnamed, tool_template
from fastdpo.config.compat.llamafactory import LLAMAFACTORY
from fastdpo.config.compat.openrlhf import COLUMN_FLAGS, OPENRLHF
from fastdpo.config.compat.swift import RLHF_TYPES, SWIFT
from fastdpo.config.compat.trl import TRL
from fastdpo.config.parallel import LESS_MEMORY
from fastdpo.errors import FastDPOError

__all__ = ["FOREIGN", "LESS_MEMORY", "RLHF_TYPES", "SOURCES", "Foreign", "add_foreign_flags",
           "apply_foreign", "foreign_flags"]

log = logging.getLogger("fastdpo")

# TRL's finish runs last: it checks that --load_in_4bit (shared with OpenRLHF) ended with LoRA adapters
SOURCES: tuple[Source, ...] = (SWIFT, LLAMAFACTORY, OPENRLHF, TRL)
FOREIGN: dict[str, Foreign] = {name: f for source in SOURCES for name, f in source.flags.items()}
assert len(FOREIGN) == sum(len(s.flags) for s in SOURCES), "a flag belongs to one tool's table"


def foreign_flags(cls: type) -> dict[str, Foreign]:
    """The other tools' flags a config class takes: all of them for training; the column keys for any command that
    reads rows with a column mapping (`fastdpo eval`)."""
    from fastdpo.config.train import TrainConfig

    if cls is TrainConfig:
        return FOREIGN
    return COLUMN_FLAGS if any(f.name == "columns" for f in dataclasses.fields(cls)) else {}


def add_foreign_flags(parser: argparse.ArgumentParser, flags: dict[str, Foreign] = FOREIGN) -> None:
    for source in SOURCES:
        if not flags.keys() & source.flags.keys():
            continue
        group = parser.add_argument_group(source.title)
        for name, f in ((n, f) for n, f in source.flags.items() if n in flags):
            kw: dict = {"default": argparse.SUPPRESS, "metavar": "VALUE", "help": f.help}
            if f.bare:
                kw.update(nargs="?", const=True)
            elif f.nargs:
                kw["nargs"] = f.nargs
            group.add_argument(f"--{name}", **kw)


def apply_foreign(given: dict, values: dict, yaml_keys: dict | None = None) -> None:
    """Give each foreign flag in `given` (name -> value) its meaning: update `values` (the config fields being
    built) in place, log a note, or raise FastDPOError. Then each tool whose flags were given settles what depends
    on several of them. `yaml_keys` (name -> YAML file) names the file of a refused value that came from one."""
    for name, value in given.items():
        try:
            text = FOREIGN[name].apply(value, values)
        except Unnamed as e:
            raise FastDPOError(_where(name, yaml_keys) + f"--{name} {_shown(value)}{e.sep}{e}") from None
        except FastDPOError as e:
            raise FastDPOError(_where(name, yaml_keys) + str(e)) from None
        if text:
            log.info("--%s %s: %s", name, _shown(value), text)
    for source in SOURCES:
        if source.finish and source.given_in(given):
            for text in source.finish(given, values):
                log.info("%s", text)
    text = tool_template(values)  # after LLaMA-Factory's `template` key: the same meaning however it came
    if text:
        log.info("%s", text)


def _where(name: str, yaml_keys: dict | None) -> str:
    return f"{yaml_keys[name]}: key {name!r}: " if yaml_keys and name in yaml_keys else ""


def _shown(value) -> str:
    return " ".join(map(str, value)) if isinstance(value, list) else str(value)
