"""Chat templates for conversational rows: the tokenizer's `chat_template`, or `--template` (a built-in name or a
Jinja file), plus `--system`.

The prompt is rendered with the generation prompt, also after a final assistant turn (a prefilled reply): as TRL's
DPOTrainer renders it, the reply is then a turn of its own and only its tokens are scored, never the end of the
prefilled turn or the next turn's header. Each completion is what the full conversation's rendering adds after it.
A template that renders the prompt differently alone than inside the conversation is reported with the row: the
completion is never silently shifted.
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from fastdpo.data.formats import Row, RowError
from fastdpo.errors import FastDPOError

log = logging.getLogger("fastdpo")

# The end-of-sequence token closes the final assistant turn in the text templates, as TRL appends it to plain text.
BUILTIN_TEMPLATES = {
    "chatml": (
        "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + (m['content'] or '') + '<|im_end|>\n' }}"
        "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
    ),
    "llama3": (
        "{{ bos_token }}{% for m in messages %}{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\n\n' + "
        "(m['content'] or '') | trim + '<|eot_id|>' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
    ),
    # message texts joined as they are: the same tokens as the equivalent plain-text row
    "identity": (
        "{{ special_prefix | default('') }}{% for m in messages %}{{ m['content'] or '' }}"
        "{% if loop.last and m['role'] == 'assistant' %}{{ eos_token }}{% endif %}{% endfor %}"
    ),
    # Anthropic HH-RLHF text layout
    "hh": (
        "{% for m in messages %}{% if m['role'] == 'user' %}{{ '\n\nHuman: ' }}{% elif m['role'] == 'assistant' %}"
        "{{ '\n\nAssistant: ' }}{% else %}{{ '\n\n' + m['role'] + ': ' }}{% endif %}{{ m['content'] or '' }}"
        "{% if loop.last and m['role'] == 'assistant' %}{{ eos_token }}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}{{ '\n\nAssistant:' }}{% endif %}"
    ),
}


def resolve_template(value: str) -> str | None:
    """--template NAME|FILE -> Jinja text; '' -> None (use the tokenizer's own)."""
    if not value:
        return None
    if value in BUILTIN_TEMPLATES:
        return BUILTIN_TEMPLATES[value]
    p = Path(value).expanduser()
    if p.is_file():
        try:
            return p.read_text(encoding="utf-8-sig")
        except (OSError, UnicodeDecodeError) as e:
            raise FastDPOError(f"--template {value}: cannot read it ({e}). Give a UTF-8 Jinja file.") from None
    raise FastDPOError(f"--template {value!r} is neither a built-in ({', '.join(sorted(BUILTIN_TEMPLATES))}) "
                       "nor an existing Jinja file.")


def keep_template(tokenizer, template: str) -> None:
    """--template NAME|FILE becomes the tokenizer's chat template, so generation (and a saved tokenizer) formats
    prompts as training rendered them; '' keeps the tokenizer's own."""
    text = resolve_template(template)
    if text:
        tokenizer.chat_template = text


def special_prefix(tokenizer) -> str:
    """The specials the tokenizer itself puts before text (e.g. BOS), which the identity template writes out."""
    return tokenizer.decode(tokenizer("")["input_ids"])


def plain_text_note(rows: list[Row], tokenizer, template: str | None = None) -> str | None:
    """A note when plain-text rows will be tokenised as they are although a chat template is at hand (`template`, or
    the tokenizer's own). TRL reads such rows that way, and so does fastdpo by default. ms-swift and LLaMA-Factory
    put the prompt in a user turn and render the template, so a run moved from them would otherwise train on
    another text layout without a word. Rows whose prompts already end their user turn as the template does (the
    template's generation prompt is in the text) were rendered beforehand: no note."""
    plain = [r for r in rows if not r.conversational]
    if not plain or not (template or getattr(tokenizer, "chat_template", None)):
        return None
    marker = turn_end(tokenizer, template)
    if marker and any(marker in r.prompt for r in plain[:200]):
        return None
    return (f"{len(plain)} plain-text rows are tokenised as they are, without the chat template (as TRL reads them). "
            "ms-swift and LLaMA-Factory put such a prompt in a user turn and render the chat template: pass "
            "--apply_chat_template true to train that way, or --input_template to wrap prompts yourself.")


def turn_end(tokenizer, template: str | None = None, timeout: float = 10.0) -> str | None:
    """What the template writes after a user message's text through its generation prompt (e.g. chatml's
    '<|im_end|>\n<|im_start|>assistant'), stripped; None when it cannot be rendered (within `timeout` seconds) or
    writes nothing."""
    mark = "\x00fastdpo\x00"
    try:
        with time_limit(timeout, lambda: None):
            text = tokenizer.apply_chat_template([{"role": "user", "content": mark}], chat_template=template,
                                                 add_generation_prompt=True, tokenize=False,
                                                 special_prefix=special_prefix(tokenizer))
    except (Exception, TemplateTimeout):  # a template is user code: without a rendering, the note stays
        return None
    after = text.split(mark, 1)[1].strip() if mark in text else ""
    return after or None


def _first_difference(a: str, b: str) -> int:
    i = 0
    while i < min(len(a), len(b)) and a[i] == b[i]:
        i += 1
    return i


def _dropped_call(messages: list[dict], text: str) -> str | None:
    """The name of a tool call missing from the rendered text (a template without tool-call support drops them)."""
    for m in messages:
        for call in m.get("tool_calls") or ():
            fn = call.get("function") if isinstance(call, dict) else None
            name = fn.get("name") if isinstance(fn, dict) else None
            if isinstance(name, str) and name not in text:
                return name
    return None


class TemplateTimeout(BaseException):
    """The time limit of a rendering passed. A BaseException, so that no `except Exception` on the way out of the
    template (Jinja's, transformers') takes it for the template's own error."""


@contextmanager
def time_limit(seconds: float, on_slow: Callable[[], None]) -> Iterator[None]:
    """Interrupt the block with TemplateTimeout after `seconds` (0: no limit). Jinja renders in Python bytecode, so
    SIGALRM's handler runs inside the template's loops and ends them; a thread could only watch. Where no alarm can
    be set (not the main thread, no SIGALRM, an interval timer already running), `on_slow` is called from a timer
    instead: the rendering goes on, but not silently."""
    if seconds <= 0:
        yield
        return
    if not (hasattr(signal, "setitimer") and threading.current_thread() is threading.main_thread()
            and signal.getitimer(signal.ITIMER_REAL)[0] == 0):
        timer = threading.Timer(seconds, on_slow)
        timer.daemon = True
        timer.start()
        try:
            yield
        finally:
            timer.cancel()
        return
    running = True

    def alarm(signum, frame) -> None:
        if running:  # not after the block ended, before the timer was cleared
            raise TemplateTimeout

    previous = signal.signal(signal.SIGALRM, alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
        running = False
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous if previous is not None else signal.SIG_DFL)


class ChatRenderer:
    """Renders conversational rows to (prompt, prompt+chosen, prompt+rejected) texts, each row within `timeout`
    seconds (0: no limit)."""

    def __init__(self, tokenizer, template: str | None = None, system: str | None = None, timeout: float = 10.0):
        self.tokenizer = tokenizer
        self.template = template
        self.system = system or None
        self.timeout = timeout
        self.extra = {"special_prefix": special_prefix(tokenizer)}

    @property
    def template_name(self) -> str:
        if self.template:
            return "--template"
        return f"the chat_template of the tokenizer {getattr(self.tokenizer, 'name_or_path', '') or ''}".rstrip()

    @property
    def available(self) -> bool:
        return bool(self.template or getattr(self.tokenizer, "chat_template", None))

    def _apply(self, messages: list[dict], row: Row, **kw) -> str:
        try:
            return self.tokenizer.apply_chat_template(messages, tools=row.tools, chat_template=self.template,
                                                      tokenize=False, **kw, **self.extra)
        except Exception as e:  # a template is user code: any error it raises is about this row or the template
            raise RowError(row.source, None, f"the chat template failed on this row ({type(e).__name__}: {e}).",
                           "Fix the row or the template (--template).", kind="chat template failed") from None

    def render(self, row: Row) -> tuple[str, str, str]:
        def slow() -> None:
            log.warning("%s: %s has been rendering this row for %g s (it cannot be interrupted here).", row.source,
                        self.template_name, self.timeout)

        try:
            with time_limit(self.timeout, slow):
                return self._render(row)
        except TemplateTimeout:
            raise RowError(row.source, None, f"{self.template_name} took more than {self.timeout:g} s to render this "
                           "row.", "A template that loops over the messages inside another loop (or a long range) "
                           "can take that long: simplify it, or raise --template_timeout (0: no limit).",
                           kind="chat template too slow") from None

    def _render(self, row: Row) -> tuple[str, str, str]:
        if not self.available:
            fix = f"Pass --template ({', '.join(sorted(BUILTIN_TEMPLATES))}) or a Jinja file."
            if row.format in ("standard", "unpaired"):  # a plain-text row made a user turn (--apply_chat_template)
                fix += " Or read plain-text rows as they are: --apply_chat_template false."
            raise RowError(row.source, None, "is conversational but the tokenizer has no chat_template.", fix,
                           kind="no chat template")
        prompt = list(row.prompt)
        if self.system and not (prompt and prompt[0]["role"] == "system"):
            prompt.insert(0, {"role": "system", "content": self.system})
        text = self._apply(prompt, row, add_generation_prompt=True) if prompt else ""
        full = [self._apply(prompt + row.chosen, row), self._apply(prompt + row.rejected, row)]
        for name, f in zip(("chosen", "rejected"), full):
            if not f.startswith(text):
                i = _first_difference(text, f)
                raise RowError(row.source, None, f"the chat template renders the prompt differently alone than before "
                               f"the {name} reply: from character {i}, alone {text[i:i + 30]!r}, in the conversation "
                               f"{f[i:i + 30]!r}.", "Use a template whose generation prompt matches how it renders "
                               "the assistant turn (--template NAME or a Jinja file).",
                               kind="prompt rendered differently")
        for messages, f in ((prompt + row.chosen, full[0]), (prompt + row.rejected, full[1])):
            name = _dropped_call(messages, f)
            if name is not None:
                raise RowError(row.source, None, f"holds a tool call of {name!r}, but the chat template does not "
                               "render tool calls: the call would be trained as an empty turn.",
                               "Use a chat template that renders tool_calls (the model's own, or --template FILE).",
                               kind="tool call not rendered")
        return text, full[0], full[1]
