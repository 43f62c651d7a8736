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
- LLaMA-Factory alpaca: `instruction` (+ `input`, joined by a newline) is the user turn after the `history` pairs
  [[user, assistant], ...]; `chosen`/`rejected` reply texts. Conversational, as LLaMA-Factory always applies the
  chat template.
- LLaMA-Factory sharegpt: `conversations` (`{from, value}` or `{role, content}` turns: an optional leading system
  turn, then user/observation turns alternating with assistant/function_call turns, ending with a user or
  observation turn), `chosen`/`rejected` one message each (or reply texts).
- orca (Intel/orca_dpo_pairs): `question` is the prompt, `chosen`/`rejected` reply texts; with a `system` column the
  row is a conversation (system + user turn), else plain text.

Unpaired rows (KTO): one completion judged desirable (`label` true) or undesirable (false), held as both `chosen` and
`rejected` of a `Row` with `label` set:
- unpaired: `prompt`, `completion` strings and `label` (TRL).
- unpaired_conversational: `prompt` a message list (or a string: one user message), `completion` an assistant message
  list (TRL).
- swift_kto: `messages` ending with the judged assistant turn, plus `label` (ms-swift); an optional `system` column.
- llamafactory_kto: a LLaMA-Factory alpaca row (`instruction` + `input`, the reply in `output`) or sharegpt row
  (`conversations` ending with the judged assistant turn) with its `kto_tag` column read as `label`.
The label is a JSON boolean (CSV cells: true / false). A row with a label and a pair's columns is refused.
Optional columns: `tools` (a list or its JSON text; passed to the chat template), `system` (conversational rows).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from fastdpo.errors import FastDPOError

FORMATS = ("standard", "conversational", "implicit_text", "implicit_conversational", "hh_rlhf", "ms_swift", "alpaca",
           "sharegpt", "orca", "unpaired", "unpaired_conversational", "swift_kto", "llamafactory_kto")
UNPAIRED_FORMATS = ("unpaired", "unpaired_conversational", "swift_kto", "llamafactory_kto")
# the columns of a pair: a row with them and a label is refused (it is one or the other)
PAIR_COLUMNS = ("chosen", "rejected", "rejected_response", "rejected_messages", "completions")
LABEL_FIX = "Write true (a desirable completion) or false (an undesirable one)."
EMPTY_PAIR = "Every pair needs two non-empty completions; fix or drop the row."
EMPTY_UNPAIRED = "An unpaired row needs a non-empty completion; fix or drop the row."
ALPACA_FIELDS = ("instruction", "input", "history")
# LLaMA-Factory's ShareGPT role tags (and their OpenAI names) -> message roles; function_call becomes a tool call
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system",
                  "observation": "tool", "tool": "tool", "function_call": "function_call"}
SHAREGPT_ORDER = ("After an optional leading system turn, conversations alternate human (or observation) and gpt (or "
                  "function_call) turns and end with the human or observation turn that chosen and rejected answer.")
SHAREGPT_KTO_ORDER = ("After an optional leading system turn, conversations alternate human (or observation) and gpt "
                      "(or function_call) turns and, in an unpaired row, end with the gpt turn its label judges.")
HH_TURN = re.compile(r"\n\n(Human|Assistant):")
# columns other datasets use for fastdpo's (Intel/orca_dpo_pairs' question, argilla's chosen_response, ...): named
# in the error of a row that lacks fastdpo's column, with the --columns mapping that reads them
COLUMN_ALIASES = {
    "prompt": ("question", "query", "instruction", "input", "prompt_text", "text"),
    "chosen": ("chosen_response", "response_chosen", "chosen_text", "response_j", "accepted", "preferred", "good"),
    "rejected": ("rejected_response", "response_rejected", "rejected_text", "response_k", "dispreferred", "bad"),
}


class RowError(FastDPOError):
    """A bad row: where it is, which field, what is wrong and how to fix it; `kind` names the problem in counts of
    invalid rows when the field and problem do not (see `reason`)."""

    def __init__(self, where: str, field: str | None, problem: str, fix: str = "", kind: str = ""):
        super().__init__(where, field, problem, fix, kind)  # all in args: picklable across worker processes
        self.where, self.field, self.problem, self.fix, self.kind = where, field, problem, fix, kind

    def __str__(self) -> str:
        what = f"field {self.field!r} " if self.field else ""
        return f"{self.where}: {what}{self.problem}" + (f" {self.fix}" if self.fix else "")

    @property
    def reason(self) -> str:
        """A short name of the problem, the same for every row that has it: 'missing prompt', 'empty chosen', ..."""
        if self.kind:
            return self.kind
        if not self.field:
            return "invalid row"
        field = re.sub(r"\[[^\]]*\]", "", self.field)  # conversations[3].from and [5].from count together
        for start, word in (("is missing", "missing"), ("is empty", "empty")):
            if self.problem.startswith(start):
                return f"{word} {field}"
        return f"invalid {field}"


@dataclass
class Row:
    """One preference pair, or one unpaired completion with its label (`label` set). Plain-text rows hold strings;
    conversational rows hold message lists (`prompt` may end with a user, tool or assistant turn; `chosen`/`rejected`
    start with an assistant turn)."""

    prompt: str | list[dict]
    chosen: str | list[dict]
    rejected: str | list[dict]
    source: str  # "file:line" or "dataset index i"
    tools: list | None = None
    format: str = "standard"
    member: int = 0  # which of the pairs its record gave (a record of several completions gives several; see groups)
    notes: tuple[tuple[str, int], ...] = ()  # on a record's first pair: what its pairing left out, counted
    dropped: str = ""  # the record gave no pair, for this reason (counted, never trained)
    # an unpaired row (KTO): one completion judged desirable (True) or undesirable (False), held as both `chosen` and
    # `rejected`; None for a pair
    label: bool | None = None
    # the images of the prompt, in the order of its <image> tags (`fastdpo.data.vision.ImageRef`: paths or encoded
    # bytes, never pixels); () for a text row
    images: tuple = ()

    @property
    def conversational(self) -> bool:
        return isinstance(self.chosen, list)

    @property
    def unpaired(self) -> bool:
        return self.label is not None

    @property
    def identical(self) -> bool:
        return self.label is None and self.chosen == self.rejected

    def key(self) -> str:
        """A canonical text of the pair, for duplicate detection."""
        fields = [self.prompt, self.chosen, self.rejected, self.tools] + ([self.label] if self.unpaired else [])
        fields += [[image.key() for image in self.images]] if self.images else []
        return json.dumps(fields, sort_keys=True, ensure_ascii=False)


def fields_present(value: dict) -> str:
    """The field names of a record, sorted and printable, for error messages ("none" when it has none)."""
    return ", ".join(sorted(map(str, value))).encode("utf-8", "backslashreplace").decode() or "none"


def _unicode(text: str, name: str, where: str) -> str:
    """Valid Unicode text: a lone surrogate (from a JSON escape such as "\\ud800") reaches no tokenizer."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise RowError(where, name, f"holds an unpaired surrogate {text[e.start]!r} at character {e.start}, which is "
                       "not valid Unicode text.", "Fix or remove that escape.") from None
    return text


def alias_of(value: dict, name: str) -> str | None:
    """A column of the row that other datasets use for fastdpo's column `name` (and that is not read as such)."""
    if name == "rejected" and value.get("messages") is not None:
        return None  # rejected_response belongs to the ms-swift row
    return next((a for a in COLUMN_ALIASES.get(name, ()) if isinstance(value.get(a), str) and value[a]), None)


def _missing(value: dict, name: str, where: str) -> RowError:
    """`name` is missing; when the row holds it under another dataset's name, the --columns mapping that reads it
    (and the other completion's, when that is missing too: argilla's chosen_response and rejected_response)."""
    fix = "Add it to the row."
    if alias_of(value, name):
        targets = [name] + [t for t in ("chosen", "rejected") if t != name and value.get(t) is None]
        mapping = {a: t for t in targets if (a := alias_of(value, t))}
        fix = (f"The row has {' and '.join(map(repr, mapping))}: read {'them' if len(mapping) > 1 else 'it'} with "
               f"--columns '{json.dumps(mapping)}'.")
    return RowError(where, name, f"is missing (fields present: {fields_present(value)}).", fix)


def _kind(x: object) -> str:
    return "null" if x is None else type(x).__name__


def _text(value: object, name: str, where: str, completion: bool, empty: str = EMPTY_PAIR) -> str:
    if not isinstance(value, str):
        raise RowError(where, name, f"must be a string or a list of messages, got {_kind(value)}.",
                       "Convert it to plain text or to [{\"role\": ..., \"content\": ...}] messages.")
    if completion and not value:
        raise RowError(where, name, "is empty.", empty)
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


def _reply(messages: list[dict], name: str, where: str, unpaired: bool = False) -> list[dict]:
    """A completion: starts with an assistant turn whose text (or tool call) is not empty."""
    first = messages[0]
    if first["role"] != "assistant":
        raise RowError(where, f"{name}[0].role", f"is {first['role']!r}, but a completion must start with an "
                       "assistant turn.", "The turns before the assistant reply belong to the prompt." if unpaired
                       else "Only the assistant reply may differ between chosen and rejected.")
    if not first.get("tool_calls") and not first.get("content"):
        raise RowError(where, f"{name}[0].content", "is empty.", EMPTY_UNPAIRED if unpaired else EMPTY_PAIR)
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


def _string(value: object, name: str, where: str) -> str:
    if not isinstance(value, str):
        raise RowError(where, name, f"must be a string, got {_kind(value)}.", "Fix the row.")
    return _unicode(value, name, where)


def _shown(x: object) -> str:
    """A value as JSON, cut short, for messages."""
    try:
        text = json.dumps(x, ensure_ascii=False)
    except (TypeError, ValueError, RecursionError):
        text = repr(x)
    return text if len(text) <= 40 else text[:37] + "..."


def read_label(x: object, name: str, where: str) -> bool:
    """An unpaired row's label, a JSON boolean (true: desirable, false: undesirable); anything else raises a
    `RowError` naming the field `name`, the value and the fix."""
    if isinstance(x, bool):
        return x
    what = {str: "the string", int: "the number", float: "the number", list: "a list", dict: "an object"}
    got = "null" if x is None else f"{what.get(type(x), _kind(x))} {_shown(x)}"
    raise RowError(where, name, f"must be a JSON boolean, got {got}.", LABEL_FIX)


def paired(value: dict) -> list[str]:
    """The columns of a pair that the record holds (not null)."""
    return [k for k in PAIR_COLUMNS if value.get(k) is not None]


def _labelled(value: dict) -> bool:
    """An unpaired record: a `label` (even null: it is then refused as not a boolean) and no pair columns."""
    return "label" in value and not paired(value)


def refuse_pair_and_label(value: dict, where: str) -> None:
    """Refuse a record with both a pair's columns and a label: it is one or the other."""
    pair = paired(value)
    if pair and value.get("label") is not None:
        raise RowError(where, "label", f"is given with a pair ({', '.join(pair)}; fields present: "
                       f"{fields_present(value)}): a row is either a pair or one completion with its label.",
                       "Keep one: drop label to train the pair, or drop the pair's columns and give prompt, "
                       "completion and label for an unpaired row.", kind="pair and label")


def _with_system(prompt: list[dict], value: dict, where: str) -> list[dict]:
    system = value.get("system")
    if system is None or (prompt and prompt[0]["role"] == "system"):
        return prompt
    system = _string(system, "system", where)
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


def _implicit_text(c: str, r: str, where: str, value: dict) -> Row:
    n = 0
    while n < min(len(c), len(r)) and c[n] == r[n]:
        n += 1
    if c == r:
        return Row("", c, r, where, format="implicit_text")
    cut = max((i for i in range(n) if c[i].isspace()), default=0)  # keep words whole; the space opens the reply
    others = [k for k, v in value.items() if k not in ("chosen", "rejected", "system", "tools")
              and isinstance(v, str) and v.strip()]
    others.sort(key=lambda k: k not in COLUMN_ALIASES["prompt"])  # a known prompt column first
    if cut == 0 and others:  # no shared text to be the prompt, and a text column that is likely to hold it
        raise RowError(where, None, f"has no prompt: chosen and rejected share no text, and the text in "
                       f"{', '.join(repr(k) for k in others)} is not read.",
                       f"If {others[0]!r} holds the prompt, name it: --columns '{{\"{others[0]}\": \"prompt\"}}' "
                       f"(or --prompt_key {others[0]}).", kind="missing prompt")
    chosen, rejected = c[cut:], r[cut:]
    for name, text in (("chosen", chosen), ("rejected", rejected)):
        if not text.strip():
            raise RowError(where, name, "adds nothing after the text it shares with the other completion.",
                           "With no prompt field, chosen and rejected must both continue the shared conversation.")
    return Row(c[:cut], chosen, rejected, where, format="implicit_text")


def _unpaired_row(value: dict, where: str, tools: list | None) -> Row:
    """TRL's unpaired row: `prompt`, `completion` (texts, or a message list and an assistant message list) and
    `label`."""
    if "label" not in value:
        raise RowError(where, "label", f"is missing (fields present: {fields_present(value)}): prompt and completion "
                       "without a label is a prompt-completion (SFT) row.", "For an unpaired row add label: true or "
                       "false; for a pair give chosen and rejected instead of completion.")
    label = read_label(value["label"], "label", where)
    for name in ("prompt", "completion"):
        if value.get(name) is None:
            raise RowError(where, name, f"is missing (fields present: {fields_present(value)}).",
                           "An unpaired row holds prompt, completion and label.")
    p, c = value["prompt"], value["completion"]
    if isinstance(c, str):
        if isinstance(p, list):
            raise RowError(where, "completion", "is a string but prompt is a list of messages.",
                           "Give completion as an assistant message list, or both as strings.")
        text = _text(c, "completion", where, True, EMPTY_UNPAIRED)
        return Row(_text(p, "prompt", where, False), text, text, where, tools, "unpaired", label=label)
    if isinstance(c, list):
        reply = _reply(_messages(c, "completion", where), "completion", where, unpaired=True)
        prompt = (_messages(p, "prompt", where) if isinstance(p, list)
                  else [{"role": "user", "content": _text(p, "prompt", where, False)}])
        return Row(_with_system(prompt, value, where), reply, reply, where, tools, "unpaired_conversational",
                   label=label)
    raise RowError(where, "completion", f"must be a string or a list of messages, got {_kind(c)}.",
                   "Convert it to plain text or to [{\"role\": \"assistant\", \"content\": ...}] messages.")


def _swift_rejected_error(value: dict, where: str) -> RowError:
    """`messages` with a `rejected` field: an ms-swift row whose rejected reply is under TRL's name."""
    return RowError(where, "rejected", "is given with messages; with messages the rejected reply goes in "
                    f"rejected_response or rejected_messages (fields present: {fields_present(value)}).",
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
            return _implicit_text(c, r, where, value)
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
    """ms-swift: `messages` ending with the chosen reply and the rejected one beside it, or (KTO) ending with the
    reply its `label` judges."""
    label = read_label(value["label"], "label", where) if _labelled(value) else None
    msgs = _messages(value["messages"], "messages", where)
    if msgs[-1]["role"] != "assistant":
        raise RowError(where, "messages", f"ends with a {msgs[-1]['role']!r} turn.",
                       f"The last message must be the {'judged' if label is not None else 'chosen'} assistant reply.")
    if label is not None:
        reply = _reply(msgs[-1:], "messages[-1]", where, unpaired=True)
        return Row(_with_system(msgs[:-1], value, where), reply, reply, where, tools, "swift_kto", label=label)
    if value.get("rejected_response") is not None:
        rejected = _text(value["rejected_response"], "rejected_response", where, True)
        prompt, chosen = msgs[:-1], _reply(msgs[-1:], "messages[-1]", where)
        return Row(_with_system(prompt, value, where), chosen, [{"role": "assistant", "content": rejected}], where,
                   tools, "ms_swift")
    if value.get("rejected_messages") is not None:
        rej = _messages(value["rejected_messages"], "rejected_messages", where)
        prompt, chosen, rejected = _split_common(msgs, rej, ("messages", "rejected_messages"), where)
        return Row(_with_system(prompt, value, where), chosen, rejected, where, tools, "ms_swift")
    raise RowError(where, "rejected_response", f"is missing (fields present: {fields_present(value)}).",
                   "An ms-swift row needs rejected_response (text) or rejected_messages (the rejected conversation).")


def _tag(m: dict) -> tuple[str, str]:
    """The role and content keys of a ShareGPT turn: {from, value} (LLaMA-Factory's default) or {role, content}
    (columnar datasets mixing both give the absent keys as null)."""
    return ("from", "value") if m.get("from") is not None else ("role", "content")


def _tool_call(text: str, name: str, where: str) -> dict:
    """A function_call turn (JSON: {"name", "arguments"} or a list of them) -> an assistant message with tool_calls."""
    try:
        calls = json.loads(text)
    except (ValueError, RecursionError):
        calls = None
    calls = calls if isinstance(calls, list) else [calls]
    if not calls or not all(isinstance(c, dict) and isinstance(c.get("name"), str) for c in calls):
        raise RowError(where, name, "is not a function call in JSON.",
                       'Write the call as {"name": ..., "arguments": {...}} (or a list of them).')
    out = []
    for c in calls:
        args = c.get("arguments", {})
        if isinstance(args, str):  # arguments as JSON text: chat templates expect the object
            try:
                args = json.loads(args)
            except (ValueError, RecursionError):
                pass
        out.append({"type": "function", "function": {"name": c["name"], "arguments": args}})
    return {"role": "assistant", "content": "", "tool_calls": out}


def _turn(m: object, name: str, where: str) -> dict:
    """One ShareGPT turn -> a message: human/user, gpt/assistant, system, observation/tool (-> tool), function_call
    (-> an assistant tool call)."""
    if not isinstance(m, dict):
        raise RowError(where, name, f"must be an object with from and value (or role and content), got {_kind(m)}.",
                       "Fix the message.")
    role_key, text_key = _tag(m)
    tag = m.get(role_key)
    if not isinstance(tag, str) or tag not in SHAREGPT_ROLES:
        raise RowError(where, f"{name}.{role_key}", f"is {tag!r}, not a ShareGPT role.",
                       f"Use one of: {', '.join(SHAREGPT_ROLES)}.")
    role = SHAREGPT_ROLES[tag]
    if role == "assistant" and m.get(text_key) is None and m.get("tool_calls"):  # OpenAI-style tool calls
        return {"role": "assistant", "content": "", "tool_calls": m["tool_calls"]}
    text = _string(m.get(text_key), f"{name}.{text_key}", where)
    return _tool_call(text, f"{name}.{text_key}", where) if role == "function_call" else {"role": role, "content": text}


def _sharegpt_turns(value: dict, where: str, judged: bool = False) -> tuple[list[dict], list[dict]]:
    """(leading system turn or nothing, the rest) of `conversations`, checked to alternate user/observation with
    assistant/function_call turns and to end with the turn the replies answer (as LLaMA-Factory requires), or, for
    an unpaired row (`judged`), with the assistant turn its label judges."""
    order = SHAREGPT_KTO_ORDER if judged else SHAREGPT_ORDER
    conv = value.get("conversations")
    if conv is None:
        raise _missing(value, "conversations", where)
    if not isinstance(conv, list) or not conv:
        raise RowError(where, "conversations", f"must be a non-empty list of turns, got {_kind(conv)}"
                       + (" (empty list)." if conv == [] else "."), "Fix the row.")
    turns = [_turn(m, f"conversations[{i}]", where) for i, m in enumerate(conv)]
    head = 1 if turns[0]["role"] == "system" else 0
    for i in range(head, len(turns)):
        user_side = (i - head) % 2 == 0
        if (turns[i]["role"] in ("user", "tool")) != user_side or turns[i]["role"] == "system":
            belongs = "a user (human) or observation" if user_side else "an assistant (gpt) or function_call"
            key = _tag(conv[i])[0]
            raise RowError(where, f"conversations[{i}].{key}", f"is {conv[i][key]!r} where {belongs} turn belongs.",
                           order)
    if judged and ((len(turns) - head) % 2 or len(turns) == head):
        last = "only a system turn" if len(turns) == head else f"a user or observation turn ({conv[-1][_tag(conv[-1])[0]]!r})"
        raise RowError(where, "conversations", f"ends with {last}, but an unpaired row ends with the assistant (or "
                       "function_call) turn its label judges.", order)
    if not judged and (len(turns) - head) % 2 == 0:
        last = "only a system turn" if len(turns) == head else f"an assistant turn ({conv[-1][_tag(conv[-1])[0]]!r})"
        raise RowError(where, "conversations", f"ends with {last}, but a preference row ends with the user (or "
                       "observation) turn that chosen and rejected answer.", SHAREGPT_ORDER)
    return turns[:head], turns[head:]


def _sharegpt_reply(value: dict, name: str, where: str) -> list[dict]:
    """`chosen`/`rejected` of a ShareGPT row: one message object (assistant or function_call), or the reply text."""
    reply = value.get(name)
    if reply is None:
        raise _missing(value, name, where)
    if isinstance(reply, str):
        return [{"role": "assistant", "content": _text(reply, name, where, True)}]
    if not isinstance(reply, dict):
        raise RowError(where, name, f"must be one message ({{from, value}} or {{role, content}}) or the reply text, "
                       f"got {_kind(reply)}.", "Give the reply alone: the turns before it go in conversations.")
    message = _turn(reply, name, where)
    if message["role"] != "assistant":
        key = _tag(reply)[0]
        raise RowError(where, f"{name}.{key}", f"is {reply[key]!r}, but a reply is an assistant (gpt) or "
                       "function_call turn.", "Give the assistant's reply.")
    return _reply([message], name, where)


def _sharegpt_row(value: dict, where: str, tools: list | None) -> Row:
    if _labelled(value):  # LLaMA-Factory KTO: the last turn is the judged reply
        label = read_label(value["label"], "label", where)
        system, turns = _sharegpt_turns(value, where, judged=True)
        reply = _reply(turns[-1:], f"conversations[{len(value['conversations']) - 1}]", where, unpaired=True)
        return Row(_with_system(system + turns[:-1], value, where), reply, reply, where, tools, "llamafactory_kto",
                   label=label)
    system, turns = _sharegpt_turns(value, where)
    chosen, rejected = (_sharegpt_reply(value, name, where) for name in ("chosen", "rejected"))
    return Row(_with_system(system + turns, value, where), chosen, rejected, where, tools, "sharegpt")


def _alpaca_history(value: dict, where: str) -> list[dict]:
    """`history` [[user, assistant], ...] -> alternating user/assistant messages."""
    history = value.get("history") or []
    if not isinstance(history, list):
        raise RowError(where, "history", f"must be a list of [user, assistant] pairs, got {_kind(history)}.",
                       "Fix the row.")
    turns = []
    for i, pair in enumerate(history):
        if not isinstance(pair, (list, tuple)) or len(pair) != 2:
            raise RowError(where, f"history[{i}]", f"must be a [user, assistant] pair of strings, got {_kind(pair)}"
                           + (f" of {len(pair)}." if isinstance(pair, (list, tuple)) else "."), "Fix the pair.")
        for role, j in (("user", 0), ("assistant", 1)):
            turns.append({"role": role, "content": _string(pair[j], f"history[{i}][{j}]", where)})
    return turns


def _alpaca_row(value: dict, where: str, tools: list | None) -> Row:
    """LLaMA-Factory alpaca: the history turns, then instruction and input (joined by a newline) as the user turn."""
    for name in ("prompt", "messages"):
        if value.get(name) is not None:
            raise RowError(where, name, f"is given with LLaMA-Factory alpaca fields (fields present: {fields_present(value)}).",
                           "Keep one form: instruction/input or prompt (rename columns with --columns).")
    if value.get("instruction") is None:
        raise RowError(where, "instruction", f"is missing (fields present: {fields_present(value)}); input and history "
                       "belong to LLaMA-Factory alpaca rows.", "Add the instruction, or name the prompt column with "
                       "--columns (e.g. '{\"input\": \"prompt\"}').")
    parts = [_string(value.get(name) or "", name, where) for name in ("instruction", "input")]
    text = "\n".join(p for p in parts if p)
    if not text:
        raise RowError(where, "instruction", "is empty, and so is input.", "Give the user's request.")
    prompt = _with_system([*_alpaca_history(value, where), {"role": "user", "content": text}], value, where)
    if _labelled(value):  # LLaMA-Factory KTO: the judged reply in output (its response column)
        label = read_label(value["label"], "label", where)
        if value.get("output") is None:
            raise RowError(where, "output", f"is missing (fields present: {fields_present(value)}); an alpaca row "
                           "with a label holds the reply it judges there.", "Add the reply as output.")
        if not isinstance(value["output"], str):
            raise RowError(where, "output", f"must be the reply text, got {_kind(value['output'])}.", "Fix the row.")
        reply = [{"role": "assistant", "content": _text(value["output"], "output", where, True, EMPTY_UNPAIRED)}]
        return Row(prompt, reply, reply, where, tools, "llamafactory_kto", label=label)
    replies = []
    for name in ("chosen", "rejected"):
        if value.get(name) is None:
            raise _missing(value, name, where)
        if not isinstance(value[name], str):
            raise RowError(where, name, f"must be the reply text in an alpaca row, got {_kind(value[name])}.",
                           "Give chosen and rejected as strings next to instruction.")
        replies.append([{"role": "assistant", "content": _text(value[name], name, where, True)}])
    return Row(prompt, replies[0], replies[1], where, tools, "alpaca")


def _is_orca(value: dict) -> bool:
    """Intel/orca_dpo_pairs' layout: `question` (+ `system`) with chosen/rejected texts, and no other prompt column."""
    return (isinstance(value.get("question"), str) and isinstance(value.get("chosen"), str)
            and isinstance(value.get("rejected"), str)
            and all(value.get(k) is None for k in ("prompt", "messages", "conversations", *ALPACA_FIELDS)))


def _orca_row(value: dict, where: str, tools: list | None) -> Row:
    """`question` is the prompt. With a `system` column the row is a conversation (system turn when not empty, the
    question as the user turn), read through the chat template as LLaMA-Factory and ms-swift read it; without one,
    plain text like prompt/chosen/rejected."""
    question = _text(value["question"], "question", where, True)
    chosen, rejected = (_text(value[name], name, where, True) for name in ("chosen", "rejected"))
    if "system" not in value:
        return Row(question, chosen, rejected, where, tools, "standard")
    prompt = _with_system([{"role": "user", "content": question}], value, where)
    return Row(prompt, [{"role": "assistant", "content": chosen}], [{"role": "assistant", "content": rejected}], where,
               tools, "orca")


def to_row(value: object, where: str, formatting: str | None = None) -> Row:
    """Normalise one decoded record to a `Row`, in the format detected (or in `formatting`, alpaca or sharegpt, when
    the dataset says which); raise `RowError` naming the field and a fix."""
    if not isinstance(value, dict):
        raise RowError(where, None, f"expected a JSON object with prompt/chosen/rejected, got {_kind(value)}.",
                       "Write one object per row.")
    tools = _tools(value, where)
    refuse_pair_and_label(value, where)
    if formatting is not None:
        return {"alpaca": _alpaca_row, "sharegpt": _sharegpt_row}[formatting](value, where, tools)
    if value.get("kto_tag") is not None and "label" not in value and not paired(value):
        raise RowError(where, "kto_tag", "is LLaMA-Factory's KTO tag, read through the dataset's entry in "
                       "dataset_info.json (its columns name the kto_tag column).", "Name the dataset through its "
                       "dataset_info.json (dataset_dir), or read the column as the label: --columns "
                       "'{\"kto_tag\": \"label\"}'.")
    if value.get("conversations") is not None:
        return _sharegpt_row(value, where, tools)
    if _is_orca(value):
        return _orca_row(value, where, tools)
    if value.get("instruction") is not None or (value.get("prompt") is None and value.get("messages") is None and any(
            value.get(name) is not None for name in ALPACA_FIELDS)):  # never the implicit prompt: it would drop them
        return _alpaca_row(value, where, tools)
    if value.get("messages") is None and not paired(value) and ("label" in value or value.get("completion") is not None):
        return _unpaired_row(value, where, tools)
    if "chosen" in value or "rejected" in value:  # before `messages`: some TRL datasets add an SFT copy of chosen
        return _pair_row(value, where, tools)
    if value.get("messages") is not None:
        return _swift_row(value, where, tools)
    if "prompt" in value:
        raise _missing(value, "chosen", where)
    raise RowError(where, None, f"has no preference fields (fields present: {fields_present(value)}).",
                   "Give prompt/chosen/rejected, chosen/rejected, messages + rejected_response, instruction + "
                   "chosen/rejected or conversations + chosen/rejected (or name your columns with --columns); for "
                   "unpaired rows prompt/completion/label or messages + label.")
