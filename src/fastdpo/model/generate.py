"""Generation with a loaded model: which model to run (base, adapter or checkpoint on top), sampling settings, and
`generate_texts(model, tokenizer, prompts, GenerationArgs(...))`, the one entry point infer, eval and the demo use:
greedy at temperature 0, answers returned in prompt order."""

from __future__ import annotations

import contextlib
import copy
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from fastdpo.config.sections.generation import GenerationArgs, ModelArgs
from fastdpo.data.template import keep_template, special_prefix, turn_end
from fastdpo.data.vision import IMAGE_TAG, ImageRef
from fastdpo.data.vision_tokenize import PixelOptions, image_parts
from fastdpo.errors import FastDPOError
from fastdpo.model.backend import use_model_attention
from fastdpo.model.load import base_causal_lm, is_vision_config, load_model, load_tokenizer, resolve_device, resolve_dtype
from fastdpo.model.processor import load_processor

log = logging.getLogger("fastdpo")

Prompt = str | list  # plain prompt text, or a list of chat messages {"role", "content"}


@dataclass
class Loaded:
    """A model ready to generate. `base` is a separate base model (full checkpoints only); with an adapter the base is
    the same model with the adapter switched off. `processor`: a vision-language model's (`load_processor`), None for
    a text-only model."""

    model: torch.nn.Module
    tokenizer: object
    tuned: bool  # an adapter or checkpoint is on top of --model
    base: torch.nn.Module | None = None
    processor: object = None

    def base_model(self):
        """Context manager yielding the base model: adapters disabled, or the separate base."""
        if self.base is not None:
            return contextlib.nullcontext(self.base)
        if hasattr(self.model, "disable_adapter"):
            return _adapter_off(self.model)
        return contextlib.nullcontext(self.model)


@contextlib.contextmanager
def _adapter_off(model):
    with model.disable_adapter():
        yield model


def checkpoint_kind(path: str, flag: str) -> str:
    """`adapter` (PEFT adapter dir) or `full` (HF model dir); a clear error otherwise."""
    p = Path(path).expanduser()
    if not p.is_dir():
        raise FastDPOError(f"--{flag} {path}: directory not found.")
    if (p / "adapter_config.json").is_file():
        return "adapter"
    if (p / "config.json").is_file():
        return "full"
    hint = ""
    if (p / "final").is_dir():
        hint = f" It looks like a training output_dir: use {p / 'final'} or one of its checkpoint-N dirs."
    raise FastDPOError(f"--{flag} {path}: neither a PEFT adapter (adapter_config.json) nor an HF model dir "
                       f"(config.json).{hint}")


def load_adapter(model, path: str, flag: str = "adapters"):
    from peft import PeftModel

    if checkpoint_kind(path, flag) != "adapter":
        raise FastDPOError(f"--{flag} {path} is a full model, not an adapter. Pass it as --checkpoint instead.")
    try:
        return PeftModel.from_pretrained(model, path, is_trainable=False)
    except (ValueError, RuntimeError, KeyError) as e:
        raise FastDPOError(f"--{flag} {path} does not fit --model: {str(e).splitlines()[0]}") from None


def load_for_generation(args: ModelArgs, need_base: bool = False) -> Loaded:
    """Load --model with --adapters / --checkpoint on top, in eval mode. `need_base` also loads the base model when the
    checkpoint is a full model (with an adapter, the base is the adapter switched off: no second copy)."""
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.torch_dtype, device)
    adapter = args.adapters or ""
    full = ""
    if args.checkpoint:
        kind = checkpoint_kind(args.checkpoint, "checkpoint")
        adapter, full = (args.checkpoint, "") if kind == "adapter" else ("", args.checkpoint)
    tuned_dir = full or adapter
    tok_dir = tuned_dir if tuned_dir and has_tokenizer(tuned_dir) else args.model  # training saves its tokenizer
    tokenizer = load_tokenizer(tok_dir, args.trust_remote_code)
    keep_template(tokenizer, getattr(args, "template", ""))
    if full:
        model = load_model(full, dtype, device, args.trust_remote_code)
        base = load_model(args.model, dtype, device, args.trust_remote_code) if need_base else None
        if base is not None:
            base.eval()
        return Loaded(model.eval(), tokenizer, True, base, vision_processor(model, full, args))
    model = load_model(args.model, dtype, device, args.trust_remote_code)
    if adapter:
        model = load_adapter(model, adapter, "checkpoint" if args.checkpoint else "adapters")
    return Loaded(model.eval(), tokenizer, bool(adapter), processor=vision_processor(model, "", args))


def vision_processor(model, full: str, args: ModelArgs):
    """A vision-language model's processor: the full checkpoint's when it saved one (training and export copy the
    processor files), else --model's; None for a text-only model."""
    if not is_vision_config(base_causal_lm(model).config):
        return None
    own = full and any((Path(full) / n).is_file() for n in ("preprocessor_config.json", "processor_config.json"))
    return load_processor(full if own else args.model, args.trust_remote_code)


def has_tokenizer(path: str) -> bool:
    return any((Path(path) / n).exists() for n in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model"))


def prompt_ids(tokenizer, prompt: Prompt, system: str = "", use_chat_template: bool = True,
               rendered: str | None = None) -> list[int]:
    """Token ids of one prompt: through the chat template (with the generation prompt) when the tokenizer has one,
    else the plain text tokenised the way training tokenises prompts. Text that already holds `rendered` (the
    template's end of a user turn through its generation prompt, `turn_end`) was rendered beforehand: it is
    tokenised as it is, not wrapped in a second user turn."""
    template = use_chat_template and getattr(tokenizer, "chat_template", None)
    if template and isinstance(prompt, str) and rendered and rendered in prompt:
        if system:
            raise FastDPOError("A prompt already rendered with the chat template cannot take --system (or a row's "
                               "`system`). Put the system turn into the prompt text, or give the prompt unrendered.")
        template = None
    if template:
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        if system and not any(m.get("role") == "system" for m in messages):
            messages = [{"role": "system", "content": system}, *messages]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False,
                                             special_prefix=special_prefix(tokenizer))  # as training renders
        return tokenizer(text, add_special_tokens=False)["input_ids"]
    if not isinstance(prompt, str):
        raise FastDPOError("Chat `messages` need a tokenizer with a chat template; this model has none. "
                           "Give `prompt` text instead.")
    if system:
        raise FastDPOError("--system goes into the chat template's system turn, and this prompt goes in without a "
                           "template (the tokenizer has none, --use_chat_template false, or plain-text preference "
                           "data, which training reads as it is). Put the instructions into the prompt text instead.")
    return tokenizer(prompt)["input_ids"]


def generation_config(model, tokenizer, gen: GenerationArgs):
    """The model's own generation config (stop tokens etc.) with our sampling settings on top."""
    from transformers import GenerationConfig

    base = getattr(model, "generation_config", None)
    cfg = copy.deepcopy(base) if base is not None else GenerationConfig()
    sample = gen.temperature > 0
    cfg.update(max_new_tokens=gen.max_new_tokens, do_sample=sample, num_beams=1,
               temperature=gen.temperature if sample else None, top_p=gen.top_p if sample else None,
               top_k=gen.top_k if sample and gen.top_k > 0 else None,
               repetition_penalty=gen.repetition_penalty if gen.repetition_penalty != 1.0 else None)
    cfg.max_length = None
    if cfg.eos_token_id is None:
        cfg.eos_token_id = tokenizer.eos_token_id
    cfg.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return cfg


@torch.no_grad()
def generate_ids(model, tokenizer, prompts: list[Prompt], gen: GenerationArgs | None = None,
                 streamer=None) -> list[list[int]]:
    """Generated token ids (prompt excluded, stop token kept if produced) for each prompt, in order.
    Batches of `gen.max_batch_size`, left-padded; `streamer` (a transformers streamer) needs a single prompt."""
    gen = gen or GenerationArgs()
    assert streamer is None or len(prompts) == 1, "streaming needs a single prompt"
    use_model_attention(model)  # packed forwards (training, eval) switch attention to the pair layout
    was_training = model.training
    model.eval()
    cfg = generation_config(model, tokenizer, gen)
    device = next(model.parameters()).device
    rendered = turn_end(tokenizer) if gen.use_chat_template and getattr(tokenizer, "chat_template", None) \
        else None
    ids = [prompt_ids(tokenizer, p, gen.system, gen.use_chat_template, rendered) for p in prompts]
    out: list[list[int]] = []
    if gen.temperature > 0:
        torch.manual_seed(gen.seed)
    try:
        for s in range(0, len(ids), gen.max_batch_size):
            part = ids[s : s + gen.max_batch_size]
            width = max(len(x) for x in part)
            input_ids = torch.full((len(part), width), cfg.pad_token_id, dtype=torch.long)
            mask = torch.zeros((len(part), width), dtype=torch.long)
            for i, x in enumerate(part):  # left padding: every prompt ends where generation starts
                input_ids[i, width - len(x) :] = torch.tensor(x, dtype=torch.long)
                mask[i, width - len(x) :] = 1
            seqs = model.generate(input_ids=input_ids.to(device), attention_mask=mask.to(device),
                                  generation_config=cfg, streamer=streamer)
            for row in seqs[:, width:].tolist():
                out.append(_strip_after_stop(row, cfg))
    finally:
        model.train(was_training)
    return out


def with_image_tags(prompt: Prompt, count: int) -> Prompt:
    """A prompt for `count` images: as it is when its `<image>` tags (in its user turns) number `count`; with `count`
    tags put before the text of its first user turn when it has none; a FastDPOError otherwise."""
    turns = [prompt] if isinstance(prompt, str) else [m.get("content") for m in prompt if m.get("role") == "user"]
    tags = sum(t.count(IMAGE_TAG) for t in turns if isinstance(t, str))
    if tags == count:
        return prompt
    if tags:
        raise FastDPOError(f"The prompt has {tags} {IMAGE_TAG} tag{'s' * (tags != 1)} and {count} image"
                           f"{'s' * (count != 1)} were given: give one image per tag, in the order of the tags (or "
                           "no tag at all: the images then go before the prompt's text).")
    if isinstance(prompt, str):
        return IMAGE_TAG * count + prompt
    first = next((i for i, m in enumerate(prompt) if m.get("role") == "user" and isinstance(m.get("content"), str)),
                 None)
    if first is None:
        raise FastDPOError("The conversation has no user turn with text content to hold the images.")
    out = [dict(m) for m in prompt]
    out[first]["content"] = IMAGE_TAG * count + out[first]["content"]
    return out


@torch.no_grad()
def generate_vision_ids(model, processor, prompts: list[Prompt], images: list[tuple[ImageRef, ...]],
                        gen: GenerationArgs | None = None, streamer=None,
                        pixels: PixelOptions | None = None) -> list[list[int]]:
    """`generate_ids` for a vision-language model: each prompt (its `<image>` tags, one per image of `images[i]`,
    `with_image_tags`) rendered with the processor's chat template, each tag as an image part, and the processor's
    inputs (input_ids, pixel_values, and Qwen2-VL's image_grid_thw and mm_token_type_ids) handed to the model's
    `generate`. One prompt at a time: the prompts' images differ in size. Image size: `pixels` (the bounds a
    training run used), else the processor's own, or ms-swift's MAX_PIXELS / MIN_PIXELS environment variables (as
    training reads them without --max_pixels / --min_pixels)."""
    gen = gen or GenerationArgs()
    assert len(images) == len(prompts) and (streamer is None or len(prompts) == 1)
    use_model_attention(model)
    was_training = model.training
    model.eval()
    cfg = generation_config(model, processor.tokenizer, gen)
    device = next(model.parameters()).device
    size = (pixels or PixelOptions.resolve()).size(processor.image_processor)
    if gen.temperature > 0:
        torch.manual_seed(gen.seed)
    out: list[list[int]] = []
    try:
        for prompt, refs in zip(prompts, images):
            prompt = with_image_tags(prompt, len(refs))
            messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
            if gen.system and not any(m.get("role") == "system" for m in messages):
                messages = [{"role": "system", "content": gen.system}, *messages]
            text = processor.apply_chat_template(image_parts(messages), add_generation_prompt=True, tokenize=False)
            pictures = [_loaded(ref) for ref in refs] or None
            kw = {"size": size} if pictures and size else {}
            enc = processor(text=[text], images=pictures, return_tensors="pt", add_special_tokens=False, **kw)
            seqs = model.generate(**enc.to(device), generation_config=cfg, streamer=streamer)
            out.append(_strip_after_stop(seqs[0, enc["input_ids"].shape[1]:].tolist(), cfg))
    finally:
        model.train(was_training)
    return out


def _loaded(ref: ImageRef):
    """The image loaded and its file closed (as training opens them)."""
    with ref.open() as im:
        im.load()
        return im.copy()


def _strip_after_stop(row: list[int], cfg) -> list[int]:
    """Cut the padding `generate` adds after a sequence has stopped (keeps the stop token)."""
    stops = cfg.eos_token_id if isinstance(cfg.eos_token_id, list) else [cfg.eos_token_id]
    for i, t in enumerate(row):
        if t in stops:
            return row[: i + 1]
    return row


def generate_texts(model, tokenizer, prompts: list[Prompt], gen: GenerationArgs | None = None,
                   streamer=None) -> list[str]:
    """Answers to `prompts` (text or chat messages), in order, special tokens removed. Greedy unless
    `gen.temperature` > 0. Uses the chat template when the tokenizer has one, plain prompt text otherwise."""
    return [tokenizer.decode(x, skip_special_tokens=True).strip() for x in
            generate_ids(model, tokenizer, prompts, gen, streamer)]


@dataclass
class Answers:
    """Generated answers in prompt order, and which of them ran out of --max_new_tokens before a stop token."""

    texts: list[str]
    truncated: list[bool]

    @property
    def empty(self) -> int:
        return sum(not t for t in self.texts)

    def problems(self, who: str, gen: GenerationArgs) -> str | None:
        """A warning naming how many answers are empty or cut at --max_new_tokens, or None."""
        n, cut = len(self.texts), sum(self.truncated)
        parts = ([f"{self.empty} of {n} {who} answers are empty"] if self.empty else []) + (
            [f"{cut} of {n} stopped at --max_new_tokens {gen.max_new_tokens} before a stop token"] if cut else [])
        return "; ".join(parts) or None


def answers_as_read(model, tokenizer, prompts: list[Prompt], gen: GenerationArgs) -> Answers:
    """Answers to prompts of preference data, in order, each going in as training read it: plain text as it is
    (training tokenises plain-text rows without a chat template), message lists through the template."""
    texts: list[str] = [""] * len(prompts)
    truncated = [False] * len(prompts)
    for plain in (True, False):
        idx = [i for i, p in enumerate(prompts) if isinstance(p, str) == plain]
        if idx:
            part = copy.copy(gen)
            part.use_chat_template = gen.use_chat_template and not plain
            stops = generation_config(model, tokenizer, part).eos_token_id
            stops = set(stops if isinstance(stops, list) else [stops])
            for i, ids in zip(idx, generate_ids(model, tokenizer, [prompts[i] for i in idx], part)):
                texts[i] = tokenizer.decode(ids, skip_special_tokens=True).strip()
                truncated[i] = len(ids) >= part.max_new_tokens and not (ids and ids[-1] in stops)
    return Answers(texts, truncated)


def answer_as_read(model, tokenizer, prompts: list[Prompt], gen: GenerationArgs) -> list[str]:
    """The texts of `answers_as_read`."""
    return answers_as_read(model, tokenizer, prompts, gen).texts
