"""Prompt-only rows: prompts to answer and score, without chosen/rejected.

A prompt row is one of
- `prompt`: text, or a list of messages (TRL's prompt-only datasets);
- `messages` ending in a user turn (ms-swift); one ending in an assistant turn has that turn taken off and kept as
  the reference `response`;
- `query` (ms-swift), with optional `history` [[user, assistant], ...] and `response`;
- `instruction` (+ `input`, `history`) (LLaMA-Factory alpaca), with optional `output`;
- `question` (Intel/orca style).
An optional `system` becomes the conversation's system turn. A preference row (with chosen/rejected) also reads as
its prompt, chosen and rejected. Every other field of the record goes to a reward function as a column.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from itertools import islice

from fastdpo.data.columns import AS_GIVEN, RowOptions
from fastdpo.data.formats import Row, RowError
from fastdpo.data.groups import to_rows
from fastdpo.data.sources import Spec, iter_records, select
from fastdpo.data.sources import parse_spec as parse_dataset_spec

Prompt = str | list[dict]

# fields that make a record a preference pair (read through `to_rows`)
# fields of a preference record (pairs, scored completions, an unpaired row's judged completion)
PAIR_FIELDS = ("chosen", "rejected", "rejected_response", "rejected_messages", "completions", "completion", "label",
               "kto_tag")
PROMPT_FIELDS = ("prompt", "messages", "query", "instruction", "question")
ROLES = ("system", "user", "assistant", "tool")


@dataclass
class PromptRow:
    """One prompt to answer: text or messages, where it was read, and the record's other fields."""

    prompt: Prompt
    source: str
    fields: dict = field(default_factory=dict)


def is_prompt_only(value: object) -> bool:
    """A record with a prompt and no preference fields."""
    return (isinstance(value, dict) and not any(value.get(k) is not None for k in PAIR_FIELDS)
            and value.get("conversations") is None and any(value.get(k) is not None for k in PROMPT_FIELDS))


def first_record(specs: list[str], split: str = "train", read: RowOptions = AS_GIVEN) -> tuple[str, object] | None:
    """(where, value) of the first readable record of the first dataset, with --columns applied; None if empty or
    if that dataset has a reading of its own (--dataset_info)."""
    for text in specs:
        if read.reading(text) is not None:  # --dataset_info's reading names its own columns: read as it says
            return None
        for rec in islice(iter_records(parse_dataset_spec(text), split, limit=read.max_row_bytes), 1):
            if rec.error is None:
                return rec.where, read.rename(rec.value, rec.where)
    return None


def load_prompts(specs: list[str], seed: int = 42, split: str = "train", read: RowOptions = AS_GIVEN) -> list[PromptRow]:
    """The prompt rows of every dataset, in order, `#N`-sampled as training samples rows; plain-text prompts get
    --input_template or --apply_chat_template as training reads them."""
    out: list[PromptRow] = []
    for text in specs:
        spec: Spec = parse_dataset_spec(text)
        rows = []
        for rec in iter_records(spec, split, limit=read.max_row_bytes):
            if rec.error is not None:
                raise RowError(rec.where, None, rec.error)
            value = read.rename(rec.value, rec.where)
            if rec.text_cells and isinstance(value, dict):  # CSV: message lists are JSON text
                value = {k: _json_cell(v) if k in ("prompt", "messages", "history") else v for k, v in value.items()}
            rows.append(to_prompt(value, rec.where, read))
        if not rows:
            raise RowError(spec.label, None, "has no rows.")
        out.extend(select(rows, spec, seed, first=read.max_samples))
    return out


def _json_cell(v: object) -> object:
    if isinstance(v, str) and v.lstrip().startswith("["):
        try:
            return json.loads(v)
        except ValueError:
            return v
    return v


def to_prompt(value: object, where: str, read: RowOptions = AS_GIVEN) -> PromptRow:
    """One record as a prompt row (see the module docstring); raises RowError naming the field and a fix."""
    if not isinstance(value, dict):
        raise RowError(where, None, f"expected a JSON object with a prompt, got {type(value).__name__}.",
                       "Write one object per row, e.g. {\"prompt\": \"...\"}.")
    if not is_prompt_only(value):
        if any(value.get(k) is not None for k in PAIR_FIELDS) or value.get("conversations") is not None:
            row = to_rows(value, where)[0]  # a record of several completions: its first pair's
            return PromptRow(_adapt(row.prompt, where, read), where,
                             {**_extras(value), "chosen": row.chosen, "rejected": row.rejected})
        raise RowError(where, None, f"has no prompt (fields present: {', '.join(sorted(value)) or 'none'}).",
                       "Give `prompt` (text or messages), `messages` ending in a user turn, `query`, `instruction` "
                       "or `question` (or name your column with --columns '{\"your_column\": \"prompt\"}').")
    fields = _extras(value)
    if value.get("prompt") is not None:
        prompt = _text_or_messages(value["prompt"], "prompt", where)
    elif value.get("messages") is not None:
        prompt = _messages(value["messages"], "messages", where)
        if prompt[-1]["role"] == "assistant":  # an SFT row: its reply is the reference answer
            fields.setdefault("response", prompt[-1]["content"])
            prompt = prompt[:-1]
        if not prompt or prompt[-1]["role"] not in ("user", "tool"):
            raise RowError(where, "messages", "has no user turn to answer.", "End the conversation with a user turn.")
    elif value.get("query") is not None:
        prompt = [*_history(value, where), {"role": "user", "content": _string(value["query"], "query", where)}]
    elif value.get("instruction") is not None:
        parts = [_string(value.get(k) or "", k, where) for k in ("instruction", "input")]
        prompt = [*_history(value, where), {"role": "user", "content": "\n".join(p for p in parts if p)}]
    else:
        prompt = _string(value["question"], "question", where)
    if value.get("system") is not None:
        system = _string(value["system"], "system", where)
        if isinstance(prompt, str):
            prompt = [{"role": "user", "content": prompt}]
        if system and prompt[0]["role"] != "system":
            prompt = [{"role": "system", "content": system}, *prompt]
    if not prompt:
        raise RowError(where, "prompt", "is empty.", "Give the text to answer.")
    return PromptRow(_adapt(prompt, where, read), where, fields)


def _adapt(prompt: Prompt, where: str, read: RowOptions) -> Prompt:
    """--input_template / --apply_chat_template on a plain-text prompt, as training applies them (`RowOptions.adapt`)."""
    if not isinstance(prompt, str) or not (read.input_template or read.apply_chat_template):
        return prompt
    return read.adapt(Row(prompt, "", "", where)).prompt


def _extras(value: dict) -> dict:
    return {k: v for k, v in value.items() if k not in (*PROMPT_FIELDS, *PAIR_FIELDS, "system", "history", "input",
                                                         "conversations")}


def _string(value: object, name: str, where: str) -> str:
    if not isinstance(value, str):
        raise RowError(where, name, f"must be a string, got {type(value).__name__}.", "Fix the row.")
    return value


def _text_or_messages(value: object, name: str, where: str) -> Prompt:
    if isinstance(value, str):
        if not value.strip():
            raise RowError(where, name, "is empty.", "Give the text to answer.")
        return value
    return _messages(value, name, where)


def _messages(value: object, name: str, where: str) -> list[dict]:
    if not isinstance(value, list) or not value:
        raise RowError(where, name, f"must be a non-empty list of {{role, content}} messages, got "
                       f"{type(value).__name__}.", "Fix the row.")
    out = []
    for i, m in enumerate(value):
        if not (isinstance(m, dict) and m.get("role") in ROLES and isinstance(m.get("content"), str)):
            raise RowError(where, f"{name}[{i}]", f"must be {{\"role\": {'|'.join(ROLES)}, \"content\": text}}.",
                           "Fix the message.")
        out.append({"role": m["role"], "content": m["content"]})
    return out


def _history(value: dict, where: str) -> list[dict]:
    """`history` [[user, assistant], ...] as alternating turns."""
    history = value.get("history") or []
    turns = []
    for i, pair in enumerate(history if isinstance(history, list) else [None]):
        if not (isinstance(pair, (list, tuple)) and len(pair) == 2 and all(isinstance(t, str) for t in pair)):
            raise RowError(where, f"history[{i}]", "must be a [user, assistant] pair of strings.", "Fix the pair.")
        turns += [{"role": "user", "content": pair[0]}, {"role": "assistant", "content": pair[1]}]
    return turns
