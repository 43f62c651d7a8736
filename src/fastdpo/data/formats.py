"""Preference row formats users bring, normalised to one `Row`.

Accepted (detected per row, so files may mix them):
- standard: `prompt`, `chosen`, `rejected` as strings (TRL).
- conversational: `prompt` a message list, `chosen`/`rejected` assistant message lists (TRL). A string `prompt` with
  message-list completions becomes one user message.
- implicit prompt: `chosen`/`rejected` only. Message lists: the prompt is their longest common prefix of messages.
  Texts: the prompt is their common prefix, cut back to the last whitespace (the space goes to the completions).
- HH-RLHF text: `chosen`/`rejected` like "\\n\\nHuman: ...\\n\\nAssistant: ...": parsed into user/assistant turns,
  then as implicit conversational rows.
- ms-swift: `messages` ending with the chosen assistant turn, plus `rejected_response` (text) or `rejected_messages`
  (the whole rejected conversation); an optional `system` column.
Optional columns: `tools` (a list or its JSON text; passed to the chat template), `system` (conversational rows).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from fastdpo.errors import FastDPOError

FORMATS = ("standard", "conversational", "implicit_text", "implicit_conversational", "hh_rlhf", "ms_swift")
HH_TURN = re.compile(r"\n\n(Human|Assistant):")


class RowError(FastDPOError):
    """A bad row: where it is, which field, what is wrong and how to fix it."""

    def __init__(self, where: str, field: str | None, problem: str, fix: str = ""):
        super().__init__(where, field, problem, fix)  # all in args: picklable across worker processes
        self.where, self.field, self.problem, self.fix = where, field, problem, fix

    def __str__(self) -> str:
        what = f"field {self.field!r} " if self.field else ""
        return f"{self.where}: {what}{self.problem}" + (f" {self.fix}" if self.fix else "")


@dataclass
class Row:
    """One preference pair. Plain-text rows hold strings; conversational rows hold message lists
    (`prompt` may end with a user, tool or assistant turn; `chosen`/`rejected` start with an assistant turn)."""

    prompt: str | list[dict]
    chosen: str | list[dict]
    rejected: str | list[dict]
    source: str  # "file:line" or "dataset index i"
    tools: list | None = None
    format: str = "standard"

    @property
    def conversational(self) -> bool:
        return isinstance(self.chosen, list)

    @property
    def identical(self) -> bool:
        return self.chosen == self.rejected

    def key(self) -> str:
        """A canonical text of the pair, for duplicate detection."""
        return json.dumps([self.prompt, self.chosen, self.rejected, self.tools], sort_keys=True, ensure_ascii=False)


def _fields(value: dict) -> str:
    return ", ".join(sorted(map(str, value))).encode("utf-8", "backslashreplace").decode() or "none"


def _unicode(text: str, name: str, where: str) -> str:
    """Valid Unicode text: a lone surrogate (from a JSON escape such as "\\ud800") reaches no tokenizer."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise RowError(where, name, f"holds an unpaired surrogate {text[e.start]!r} at character {e.start}, which is "
                       "not valid Unicode text.", "Fix or remove that escape.") from None
    return text


def _missing(value: dict, name: str, where: str) -> RowError:
    return RowError(where, name, f"is missing (fields present: {_fields(value)}).", "Add it to the row.")


def _kind(x: object) -> str:
    return "null" if x is None else type(x).__name__


def _text(value: object, name: str, where: str, completion: bool) -> str:
    if not isinstance(value, str):
        raise RowError(where, name, f"must be a string or a list of messages, got {_kind(value)}.",
                       "Convert it to plain text or to [{\"role\": ..., \"content\": ...}] messages.")
    if completion and not value:
        raise RowError(where, name, "is empty.", "Every pair needs two non-empty completions; fix or drop the row.")
    return _unicode(value, name, where)


def _messages(value: object, name: str, where: str) -> list[dict]:
    """Validate a message list; drop keys whose value is null (columnar datasets add them to every message)."""
    if not isinstance(value, list) or not value:
        raise RowError(where, name, f"must be a non-empty list of {{role, content}} messages, got {_kind(value)}"
                       + (" (empty list)." if value == [] else "."), "Fix the row.")
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, dict):
            raise RowError(where, f"{name}[{i}]", f"must be an object with role and content, got {_kind(m)}.",
                           "Fix the message.")
        role = m.get("role")
        if not isinstance(role, str) or not role:
            raise RowError(where, f"{name}[{i}].role", "is missing or not a string.",
                           "Give every message a role (system, user, assistant or tool).")
        content = m.get("content")
        if content is None and not m.get("tool_calls"):
            raise RowError(where, f"{name}[{i}].content", "is missing.", "Give every message its text.")
        if content is not None and not isinstance(content, str):
            raise RowError(where, f"{name}[{i}].content", f"must be a string, got {_kind(content)}.",
                           "Only text content is supported: join the text parts into one string.")
        for k, v in m.items():
            if isinstance(v, str):
                _unicode(v, f"{name}[{i}].{k}", where)
        out.append({k: v for k, v in m.items() if v is not None})
    return out


def _reply(messages: list[dict], name: str, where: str) -> list[dict]:
    """A completion: starts with an assistant turn whose text (or tool call) is not empty."""
    first = messages[0]
    if first["role"] != "assistant":
        raise RowError(where, f"{name}[0].role", f"is {first['role']!r}, but a completion must start with an "
                       "assistant turn.", "Only the assistant reply may differ between chosen and rejected.")
    if not first.get("tool_calls") and not first.get("content"):
        raise RowError(where, f"{name}[0].content", "is empty.",
                       "Every pair needs two non-empty completions; fix or drop the row.")
    return messages


def _split_common(c: list[dict], r: list[dict], names: tuple[str, str], where: str) -> tuple[list, list, list]:
    """Longest common prefix of two conversations -> (prompt, chosen rest, rejected rest)."""
    k = 0
    while k < min(len(c), len(r)) and c[k] == r[k]:
        k += 1
    if k == len(c) and k == len(r):
        return c[:-1], c[-1:], r[-1:]  # identical conversations: flagged later as an identical pair
    for rest, name in ((c[k:], names[0]), (r[k:], names[1])):
        if not rest:
            raise RowError(where, name, f"ends where the other conversation continues (after message {k - 1}).",
                           "Both conversations must end with their own assistant reply.")
    return c[:k], _reply(c[k:], f"{names[0]}[{k}:]", where), _reply(r[k:], f"{names[1]}[{k}:]", where)


def _with_system(prompt: list[dict], value: dict, where: str) -> list[dict]:
    system = value.get("system")
    if system is None or (prompt and prompt[0]["role"] == "system"):
        return prompt
    if not isinstance(system, str):
        raise RowError(where, "system", f"must be a string, got {_kind(system)}.", "Fix the row.")
    _unicode(system, "system", where)
    return [{"role": "system", "content": system}, *prompt] if system else prompt


def _tools(value: dict, where: str) -> list | None:
    tools = value.get("tools")
    if tools is None or tools == "":
        return None
    if isinstance(tools, str):
        try:
            tools = json.loads(tools)
        except json.JSONDecodeError as e:
            raise RowError(where, "tools", f"is not valid JSON ({e.msg}).", "Give a list of tool schemas.") from None
    if not isinstance(tools, list):
        raise RowError(where, "tools", f"must be a list of tool schemas, got {_kind(tools)}.", "Fix the row.")
    try:
        _unicode(json.dumps(tools, ensure_ascii=False), "tools", where)
    except (ValueError, RecursionError):  # nested too deeply, or a number too long to write back
        raise RowError(where, "tools", "cannot be written back as JSON.", "Fix the tool schemas.") from None
    return tools or None


def parse_hh(text: str) -> list[dict] | None:
    """"\\n\\nHuman: a\\n\\nAssistant: b" -> [user a, assistant b]; None if the text is not in that form."""
    if not text.startswith("\n\nHuman:"):
        return None
    parts = HH_TURN.split(text)  # ['', 'Human', ' a', 'Assistant', ' b', ...]
    turns = [{"role": "user" if who == "Human" else "assistant", "content": body.strip()}
             for who, body in zip(parts[1::2], parts[2::2])]
    return turns if any(t["role"] == "assistant" for t in turns) else None


def _implicit_text(c: str, r: str, where: str) -> Row:
    n = 0
    while n < min(len(c), len(r)) and c[n] == r[n]:
        n += 1
    if c == r:
        return Row("", c, r, where, format="implicit_text")
    cut = max((i for i in range(n) if c[i].isspace()), default=0)  # keep words whole; the space opens the reply
    chosen, rejected = c[cut:], r[cut:]
    for name, text in (("chosen", chosen), ("rejected", rejected)):
        if not text.strip():
            raise RowError(where, name, "adds nothing after the text it shares with the other completion.",
                           "With no prompt field, chosen and rejected must both continue the shared conversation.")
    return Row(c[:cut], chosen, rejected, where, format="implicit_text")


def _swift_rejected_error(value: dict, where: str) -> RowError:
    """`messages` with a `rejected` field: an ms-swift row whose rejected reply is under TRL's name."""
    return RowError(where, "rejected", "is given with messages; with messages the rejected reply goes in "
                    f"rejected_response or rejected_messages (fields present: {_fields(value)}).",
                    "Rename rejected to rejected_response (the rejected reply as text), or give the whole rejected "
                    "conversation as rejected_messages.")


def _pair_row(value: dict, where: str, tools: list | None) -> Row:
    if value.get("messages") is not None and value.get("chosen") is None:
        raise _swift_rejected_error(value, where)
    for name in ("chosen", "rejected"):
        if name not in value or value[name] is None:
            raise _missing(value, name, where)
    c, r, p = value["chosen"], value["rejected"], value.get("prompt")
    if isinstance(c, str) and isinstance(r, str):
        if p is None:
            c, r = _text(c, "chosen", where, True), _text(r, "rejected", where, True)
            hc, hr = parse_hh(c), parse_hh(r)
            if hc is not None and hr is not None:
                prompt, chosen, rejected = _split_common(hc, hr, ("chosen", "rejected"), where)
                return Row(_with_system(prompt, value, where), chosen, rejected, where, tools, "hh_rlhf")
            return _implicit_text(c, r, where)
        if isinstance(p, list):
            raise RowError(where, "chosen", "is a string but prompt is a list of messages.",
                           "Give chosen and rejected as assistant message lists, or all three as strings.")
        return Row(_text(p, "prompt", where, False), _text(c, "chosen", where, True), _text(r, "rejected", where, True),
                   where, tools, "standard")
    if isinstance(c, list) and isinstance(r, list):
        c, r = _messages(c, "chosen", where), _messages(r, "rejected", where)
        if isinstance(p, list):
            prompt = _with_system(_messages(p, "prompt", where), value, where)
            return Row(prompt, _reply(c, "chosen", where), _reply(r, "rejected", where), where, tools, "conversational")
        if p is None or (isinstance(p, str) and c[0]["role"] != "assistant"):
            # the conversations hold the prompt themselves (a string prompt column is then a copy of it)
            prompt, chosen, rejected = _split_common(c, r, ("chosen", "rejected"), where)
            return Row(_with_system(prompt, value, where), chosen, rejected, where, tools, "implicit_conversational")
        prompt = [{"role": "user", "content": _text(p, "prompt", where, False)}]
        return Row(_with_system(prompt, value, where), _reply(c, "chosen", where), _reply(r, "rejected", where), where,
                   tools, "conversational")
    bad = "chosen" if not isinstance(c, (str, list)) else "rejected" if not isinstance(r, (str, list)) else None
    if bad:
        raise RowError(where, bad, f"must be a string or a list of messages, got {_kind(value[bad])}.",
                       "Convert it to plain text or to [{\"role\": ..., \"content\": ...}] messages.")
    raise RowError(where, "rejected", f"is a {_kind(r)} but chosen is a {_kind(c)}.",
                   "Give chosen and rejected in the same form: both strings or both message lists.")


def _swift_row(value: dict, where: str, tools: list | None) -> Row:
    msgs = _messages(value["messages"], "messages", where)
    if msgs[-1]["role"] != "assistant":
        raise RowError(where, "messages", f"ends with a {msgs[-1]['role']!r} turn.",
                       "The last message must be the chosen assistant reply.")
    if value.get("rejected_response") is not None:
        rejected = _text(value["rejected_response"], "rejected_response", where, True)
        prompt, chosen = msgs[:-1], _reply(msgs[-1:], "messages[-1]", where)
        return Row(_with_system(prompt, value, where), chosen, [{"role": "assistant", "content": rejected}], where,
                   tools, "ms_swift")
    if value.get("rejected_messages") is not None:
        rej = _messages(value["rejected_messages"], "rejected_messages", where)
        prompt, chosen, rejected = _split_common(msgs, rej, ("messages", "rejected_messages"), where)
        return Row(_with_system(prompt, value, where), chosen, rejected, where, tools, "ms_swift")
    raise RowError(where, "rejected_response", f"is missing (fields present: {_fields(value)}).",
                   "An ms-swift row needs rejected_response (text) or rejected_messages (the rejected conversation).")


def to_row(value: object, where: str) -> Row:
    """Normalise one decoded record to a `Row`; raise `RowError` naming the field and a fix."""
    if not isinstance(value, dict):
        raise RowError(where, None, f"expected a JSON object with prompt/chosen/rejected, got {_kind(value)}.",
                       "Write one object per row.")
    tools = _tools(value, where)
    if "chosen" in value or "rejected" in value:  # before `messages`: some TRL datasets add an SFT copy of chosen
        return _pair_row(value, where, tools)
    if value.get("messages") is not None:
        return _swift_row(value, where, tools)
    if "prompt" in value:
        raise _missing(value, "chosen", where)
    raise RowError(where, None, f"has no preference fields (fields present: {_fields(value)}).",
                   "Give prompt/chosen/rejected, chosen/rejected, or messages + rejected_response.")
