"""Generation after training: load base + adapter (or a full checkpoint), format prompts with the model's chat template
(plain text without one), generate with transformers `generate`, stream single answers, compare base and tuned side by
side, or write a batch to JSONL (`fastdpo infer`).

`fastdpo.model.generate.generate_texts(model, tokenizer, prompts, GenerationArgs(...))` is the one entry point other
commands (eval, demo) use: greedy at temperature 0, answers returned in prompt order.

With a vision-language model (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, LLaVA: a base dir, adapters on it, or a trained full
model) prompts may hold images: `--images` for one --prompt / --messages (one per `<image>` tag, or put before the
text when it has no tag), and the rows with images of --val_dataset / --load_data_args, read as training reads them.
Those prompts go through the model's processor (`fastdpo.model.generate.generate_vision_ids`).
"""

from __future__ import annotations

import copy
import json
import logging
from dataclasses import dataclass
from pathlib import Path

from fastdpo.config.fields import option
from fastdpo.config.sections.generation import GenerationArgs, ModelArgs
from fastdpo.errors import FastDPOError

log = logging.getLogger("fastdpo")


@dataclass
class InferConfig(ModelArgs, GenerationArgs):
    """`fastdpo infer`: the model to run (ModelArgs), how answers are sampled (GenerationArgs), and which prompts."""

    name = "infer"
    title = "Prompts and output"

    prompt: str = option("", "One prompt; the answer is streamed to the terminal.")
    prompts: str = option("", "JSONL file, one object per line with `prompt` (text) or `messages` (chat), optional `system`.")
    messages: str = option("", "One conversation as JSON, a list of {role, content} (as ms-swift's --messages); the last "
                           "turn is answered and streamed like --prompt.")
    infer_backend: str = option("pt", "pt: transformers generate (the one backend here; ms-swift's default).")
    compare: bool = option(False, "Also answer with the base model (adapters off / --model) and print both side by side.")
    result_path: str = option("", "Where batch answers go (JSONL). Default: next to --prompts as NAME.infer.jsonl.")
    stream: bool = option(True, "Print a single prompt's answer as it is generated (ms-swift's --stream); false prints it "
                          "when done. Answers to a --prompts file are written when done either way.")
    val_dataset: list = option([], "Preference datasets whose prompts are answered (any format and source --dataset of "
                               "train takes), as ms-swift's --val_dataset; the answers, with chosen and rejected, go "
                               "to --result_path (default: next to the first as NAME.infer.jsonl).", nargs="+")
    load_data_args: bool = option(False, "Answer the held-out prompts of the run that wrote --adapters / --checkpoint (its "
                                  "saved --val_dataset, or its --split_dataset_ratio share of --dataset), as "
                                  "ms-swift's --load_data_args; answers go to --result_path (default: "
                                  "infer_held_out.jsonl in the run's output_dir).")
    template: str = option("", "Chat template for the prompts: chatml|llama3|identity|hh or a Jinja file (default: the "
                           "tokenizer's own; a model trained here saves the --template it trained with).")
    images: list = option([], "Images for --prompt / --messages (a vision-language model: Qwen2-VL, Qwen2.5-VL, "
                          "Qwen3-VL, LLaVA): one per <image> tag of the prompt, in order; a prompt without tags gets "
                          "them before its text.",
                          nargs="+")

    def validate(self) -> None:
        self.validate_model()
        self.validate_generation()
        if sum(map(bool, (self.prompt, self.prompts, self.messages, self.val_dataset, self.load_data_args))) != 1:
            raise FastDPOError("Give exactly one of --prompt TEXT, --prompts FILE.jsonl, --messages JSON, "
                               "--val_dataset DATA or --load_data_args true.")
        if self.load_data_args and not (self.adapters or self.checkpoint):
            raise FastDPOError("--load_data_args answers the held-out prompts of a training run: add --adapters or "
                               "--checkpoint with a dir it wrote (final/ or checkpoint-N/).")
        if self.infer_backend != "pt":
            raise FastDPOError(f"--infer_backend {self.infer_backend}: fastdpo generates with transformers (pt). To "
                               "serve with vLLM or another engine, merge the adapter first (fastdpo export "
                               "--merge_lora) and load the exported dir there; or drop the flag.")
        if self.messages:
            conversation(self.messages)  # raises on bad JSON or shape
        if self.compare and not (self.adapters or self.checkpoint):
            raise FastDPOError("--compare needs a tuned model to compare with the base: add --adapters or --checkpoint.")
        if self.images and not (self.prompt or self.messages):
            raise FastDPOError("--images go with one --prompt or --messages. Rows of --val_dataset carry their own "
                               "images (their images column).")
        for path in self.images:
            if not Path(path).expanduser().is_file():
                raise FastDPOError(f"--images {path}: file not found.")


# ---------------------------------------------------------------- loading


# ---------------------------------------------------------------- generation


# ---------------------------------------------------------------- prompts file and the command


def read_prompts(path: str) -> list[dict]:
    """Rows of a prompts JSONL: each with `prompt` (text) or `messages` (chat), optional `system`; other fields are
    kept and copied to the output (so a preference file works too)."""
    p = Path(path)
    if not p.is_file():
        raise FastDPOError(f"Prompts file {path} not found. Check --prompts.")
    rows = []
    for lineno, line in enumerate(p.read_text(encoding="utf-8-sig").splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise FastDPOError(f"{where}: invalid JSON ({e.msg}, column {e.colno}). Fix or remove this line.") from None
        if not isinstance(row, dict):
            raise FastDPOError(f"{where}: expected a JSON object with `prompt` or `messages`.")
        if any(row.get(k) not in (None, [], "") for k in ("images", "image")):
            raise FastDPOError(f"{where}: a row with images. --prompts reads text prompts; give rows with images as "
                               "--val_dataset (read as training reads them), or one prompt with --prompt and --images.")
        if isinstance(row.get("prompt"), str):
            pass
        elif isinstance(row.get("messages"), list) and all(isinstance(m, dict) for m in row["messages"]):
            pass
        else:
            raise FastDPOError(f"{where}: needs a `prompt` string or a `messages` list of {{role, content}} objects. "
                               "For preference data in another layout, pass the file as --val_dataset.")
        rows.append(row)
    if not rows:
        raise FastDPOError(f"Prompts file {path} has no rows.")
    return rows


def conversation(text: str) -> list[dict]:
    """--messages: a JSON list of {"role", "content"} objects."""
    try:
        messages = json.loads(text)
    except json.JSONDecodeError as e:
        raise FastDPOError(f"--messages is not valid JSON ({e.msg}, column {e.colno}). Quote it for the shell: "
                           "--messages '[{\"role\": \"user\", \"content\": \"...\"}]'.") from None
    if not (isinstance(messages, list) and messages and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages)):
        raise FastDPOError("--messages must be a non-empty JSON list of {\"role\": ..., \"content\": ...} objects.")
    return messages


def val_rows(cfg: InferConfig, images: bool = False) -> list[dict]:
    """--val_dataset's rows as prompt rows, read as the run that wrote --adapters / --checkpoint read its data (its
    --columns, --input_template, --apply_chat_template), or as given without such a run; rows with images are read
    with `images` (a vision-language model), else refused."""
    import dataclasses

    from fastdpo.checkpoint.saved_run import run_config
    from fastdpo.data.columns import AS_GIVEN, RowOptions
    from fastdpo.data.load import load_rows

    tuned = cfg.adapters or cfg.checkpoint
    trained = run_config(tuned)[0] if tuned else None
    read = AS_GIVEN if trained is None else \
        dataclasses.replace(RowOptions.from_config(trained), datasets=(), max_samples=0)
    return prompt_rows(load_rows(cfg.val_dataset, read=dataclasses.replace(read, images=images)))


def held_out_prompts(tuned: str, images: bool = False) -> tuple[list[dict], Path]:
    """The held-out rows of the run that wrote `tuned` (its final/ or a checkpoint-N/), read as training read them
    (rows with images with `images`: a vision-language model), as prompt rows (with their chosen and rejected kept);
    and the run's output_dir."""
    import dataclasses

    from fastdpo.checkpoint.saved_run import run_config
    from fastdpo.data.columns import RowOptions
    from fastdpo.data.load import load_rows
    from fastdpo.data.split import held_out_rows

    cfg, run = run_config(tuned)
    if cfg is None:
        raise FastDPOError(f"--load_data_args: no training config next to {tuned} (fastdpo saves it as "
                           f"{run / 'config.yaml'}). Give the prompts with --prompts FILE.jsonl instead.")
    if not cfg.val_dataset and cfg.split_dataset_ratio <= 0:
        raise FastDPOError(f"--load_data_args: the run in {run} held out no pairs (no --val_dataset or "
                           "--split_dataset_ratio). Give the prompts with --prompts FILE.jsonl instead.")
    read = dataclasses.replace(RowOptions.from_config(cfg), images=images)
    rows = [] if cfg.val_dataset else load_rows(cfg.dataset, cfg.seed, cfg.split, read)
    _, held = held_out_rows(cfg, rows, read)
    return prompt_rows(held), run


def run_pixels(cfg: InferConfig):
    """The image-size bounds (`PixelOptions`) of the run that wrote --adapters / --checkpoint, where it set
    --max_pixels / --min_pixels: its images are resized for generation as training resized them. None otherwise
    (the processor's own size, or the MAX_PIXELS / MIN_PIXELS environment variables)."""
    from fastdpo.checkpoint.saved_run import run_config
    from fastdpo.data.vision_tokenize import PixelOptions

    tuned = cfg.adapters or cfg.checkpoint
    trained = run_config(tuned)[0] if tuned else None
    if trained is None or not (trained.max_pixels or trained.min_pixels):
        return None
    log.info("Images resized as the run that wrote %s resized them (--max_pixels %s, --min_pixels %s).", tuned,
             trained.max_pixels or "-", trained.min_pixels or "-")
    return PixelOptions.resolve(trained.max_pixels or None, trained.min_pixels or None)


def prompt_rows(rows: list) -> list[dict]:
    """Preference rows as rows to answer: the prompt (text, or the conversation as `messages`), with chosen, rejected,
    the row's location and its images (`ImageRef`s, written as their paths) kept for the result file."""
    return [{"prompt" if isinstance(r.prompt, str) else "messages": r.prompt, "chosen": r.chosen,
             "rejected": r.rejected, "source": r.source, **({"images": list(r.images)} if r.images else {})}
            for r in rows]


def _row_prompt(row: dict):
    return row["prompt"] if isinstance(row.get("prompt"), str) else row["messages"]


def run_infer(cfg: InferConfig, console=None) -> list[dict]:
    """`fastdpo infer`: answers (and base answers with --compare) for --prompt or each row of --prompts."""
    from transformers import TextStreamer

    from fastdpo.data.vision import ImageRef
    from fastdpo.model.generate import answer_as_read, generate_texts, generate_vision_ids, load_for_generation

    cfg.validate()
    loaded = load_for_generation(cfg, need_base=cfg.compare)
    vision = loaded.processor is not None
    if cfg.images and not vision:
        raise FastDPOError(f"--images: {cfg.checkpoint or cfg.model} is a text-only model; images go to a "
                           "vision-language model (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, LLaVA). Drop --images, or give "
                           "such a model.")
    images = {"images": [ImageRef(str(Path(p).expanduser().resolve())) for p in cfg.images]} if cfg.images else {}
    pixels = run_pixels(cfg) if vision else None
    written = None  # where the answers go (none for a single prompt)
    if cfg.prompt:
        rows = [{"prompt": cfg.prompt, **images}]
    elif cfg.messages:
        rows = [{"messages": conversation(cfg.messages), **images}]
    elif cfg.val_dataset:
        rows = val_rows(cfg, vision)
        first = Path(cfg.val_dataset[0].split("#")[0])  # a file: next to it; a directory or hub dataset: here
        written = first.with_suffix(".infer.jsonl") if first.is_file() else Path(first.name + ".infer.jsonl")
    elif cfg.load_data_args:
        rows, run = held_out_prompts(cfg.adapters or cfg.checkpoint, vision)
        log.info("--load_data_args: %d held-out prompts of the run in %s.", len(rows), run)
        written = run / "infer_held_out.jsonl"
    else:
        rows = read_prompts(cfg.prompts)
        written = Path(cfg.prompts).with_suffix(".infer.jsonl")
    # preference data's prompts go in as training read them (`answer_as_read`): plain text as it is, not as a user
    # turn (rows a run read with --apply_chat_template are message lists by now, and go through the template)
    from_pairs = bool(cfg.val_dataset or cfg.load_data_args)
    plain = sum("prompt" in r for r in rows) if from_pairs else 0
    if plain and cfg.use_chat_template and getattr(loaded.tokenizer, "chat_template", None):
        log.info("%d plain-text prompts of preference data go in as training reads them: as they are, without the "
                 "chat template (a run trained with --apply_chat_template reads them as user turns).", plain)
    stream = cfg.stream and bool(cfg.prompt or cfg.messages) and not cfg.compare and console is not None

    def answer(model, prompts: list, pictures: list[tuple], gen: InferConfig) -> list[str]:
        streamer = TextStreamer(loaded.tokenizer, skip_prompt=True, skip_special_tokens=True) if stream else None
        seen = [i for i, p in enumerate(pictures) if p]  # prompts with images: through the processor
        texts = [""] * len(prompts)
        if seen:
            got = generate_vision_ids(model, loaded.processor, [prompts[i] for i in seen], [pictures[i] for i in seen],
                                      gen, streamer, pixels)
            for i, ids in zip(seen, got):
                texts[i] = loaded.tokenizer.decode(ids, skip_special_tokens=True).strip()
        rest = [i for i in range(len(prompts)) if not pictures[i]]
        if rest:
            part = [prompts[i] for i in rest]
            got = answer_as_read(model, loaded.tokenizer, part, gen) if from_pairs else \
                generate_texts(model, loaded.tokenizer, part, gen, streamer)
            for i, text in zip(rest, got):
                texts[i] = text
        return texts

    # one system prompt per call: group rows by their own system prompt (or --system)
    results: list[dict] = [dict(r) for r in rows]
    groups: dict[str, list[int]] = {}
    for i, r in enumerate(rows):
        groups.setdefault(str(r.get("system") or cfg.system), []).append(i)
    for system, idx in groups.items():
        gen = copy.copy(cfg)
        gen.system = system
        prompts = [_row_prompt(rows[i]) for i in idx]
        pictures = [tuple(rows[i].get("images") or ()) for i in idx]
        for i, a in zip(idx, answer(loaded.model, prompts, pictures, gen)):
            results[i]["response"] = a
        if cfg.compare:
            with loaded.base_model() as base:
                for i, a in zip(idx, answer(base, prompts, pictures, gen)):
                    results[i]["base_response"] = a
    if console is not None and not stream:
        show_answers(console, results, cfg.compare)
    if written is not None:
        out = Path(cfg.result_path or written)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text("".join(json.dumps(r, ensure_ascii=False, default=_label) + "\n" for r in results),
                       encoding="utf-8")
        if console is not None:
            console.print(f"wrote {len(results)} answers to {out}")
    return results


def _label(value):
    """How the result file writes what JSON cannot: an image as its path (or its size in bytes)."""
    from fastdpo.data.vision import ImageRef

    if isinstance(value, ImageRef):
        return value.label
    raise TypeError(f"{type(value).__name__} is not JSON serialisable")


def conversation_text(messages: list[dict]) -> str:
    """A conversation as readable lines, one turn each: `user: ...`, `assistant: ...` (tool calls by name)."""
    lines = []
    for m in messages:
        text = m.get("content") or ""
        calls = [c.get("function", {}).get("name", "?") for c in m.get("tool_calls") or () if isinstance(c, dict)]
        if calls:
            text = (text + " " if text else "") + " ".join(f"[calls {name}]" for name in calls)
        lines.append(f"{m.get('role', '?')}: {text}")
    return "\n".join(lines)


def show_answers(console, results: list[dict], compare: bool, limit: int = 20) -> None:
    """A readable table: prompt | answer, or prompt | base | tuned side by side."""
    from rich.table import Table

    table = Table(show_lines=True, expand=True)
    table.add_column("prompt", ratio=1)
    if compare:
        table.add_column("base", ratio=2)
        table.add_column("tuned", ratio=2)
    else:
        table.add_column("answer", ratio=2)
    for r in results[:limit]:
        prompt = r["prompt"] if isinstance(r.get("prompt"), str) else conversation_text(r.get("messages") or [])
        cells = [r.get("base_response", ""), r["response"]] if compare else [r["response"]]
        table.add_row(prompt, *cells)
    console.print(table)
    if len(results) > limit:
        console.print(f"... {len(results) - limit} more in the result file")
