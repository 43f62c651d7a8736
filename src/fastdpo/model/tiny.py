"""Tiny models and tokenizers built locally from configs (no download): for the demo, tests and smoke runs."""

from __future__ import annotations

from pathlib import Path

import torch

SPECIALS = ["<unk>", "<pad>", "<eos>", "<bos>"]

# Small shapes of each supported family; every one has GQA (2 kv heads for 4 query heads).
FAMILIES = {
    "llama": "LlamaConfig",
    "qwen2": "Qwen2Config",
    "qwen3": "Qwen3Config",
    "mistral": "MistralConfig",
    "gemma": "GemmaConfig",
}


def word_tokenizer(words: list[str], add_bos: bool = True):
    """A whitespace word-level tokenizer over `words` with <unk>/<pad>/<eos>/<bos>; prepends <bos> like Llama."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {s: i for i, s in enumerate(SPECIALS)}
    for w in words:
        vocab.setdefault(w, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    if add_bos:
        tok.post_processor = processors.TemplateProcessing(single="<bos> $A", pair="<bos> $A $B",
                                                           special_tokens=[("<bos>", vocab["<bos>"])])
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>", eos_token="<eos>",
                                   bos_token="<bos>")


def tiny_config(family: str, vocab_size: int, hidden: int = 64, layers: int = 2, **overrides):
    import transformers

    cls = getattr(transformers, FAMILIES[family])
    kw = dict(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=hidden * 2, num_hidden_layers=layers,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, pad_token_id=1,
              bos_token_id=3, eos_token_id=2, tie_word_embeddings=family in ("qwen3", "gemma"))
    if family in ("qwen3", "gemma"):
        kw["head_dim"] = hidden // 4
    if family == "mistral":
        kw["sliding_window"] = None
    kw.update(overrides)
    return cls(**kw)


def build_tiny_model(out_dir: str | Path, family: str = "qwen3", words: list[str] | None = None, seed: int = 0,
                     **overrides) -> Path:
    """Save a random-init tiny model of `family` with its tokenizer to `out_dir` (an HF model dir)."""
    from transformers import AutoModelForCausalLM

    words = words if words is not None else [f"w{i}" for i in range(60)]
    tok = word_tokenizer(words)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(family, len(tok), **overrides), dtype=torch.float32)
    out = Path(out_dir)
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    return out


# Vision-language families: (config class, model class). Their vision towers differ in shape names.
VLM_FAMILIES = {
    "qwen2_vl": ("Qwen2VLConfig", "Qwen2VLForConditionalGeneration"),
    "qwen2_5_vl": ("Qwen2_5_VLConfig", "Qwen2_5_VLForConditionalGeneration"),
    "qwen3_vl": ("Qwen3VLConfig", "Qwen3VLForConditionalGeneration"),
}
VLM_PATCH = 4  # pixels per patch side; with a 2 x 2 merge an image of 8k x 8l pixels gives k l placeholder tokens


def tiny_vlm_config(family: str, vocab_size: int, hidden: int = 64, layers: int | None = None, text: dict | None = None,
                    vision: dict | None = None, **overrides):
    """A tiny Qwen2-VL / Qwen2.5-VL / Qwen3-VL config: 2 text layers (`layers`) with GQA and M-RoPE sections (2, 3, 3)
    of a head of 16, a 2-block vision tower of 4-pixel patches merged 2 x 2. Qwen2.5-VL: one windowed block, one
    full. Qwen3-VL: interleaved sections (4, 2, 2), query and key norms, a learned 4 x 4 position grid, and both
    blocks' features added by DeepStack mergers after the first two of 3 text layers (an addition after the last
    layer would reach no completion token: image tokens predict none). The vision special tokens take the last four
    ids: image, video, vision start, vision end. `text` / `vision` replace keys of the text / vision config (a larger
    shape of the same family); `overrides` go to the top-level config."""
    import transformers

    layers = layers or (3 if family == "qwen3_vl" else 2)
    text_kw = dict(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=hidden * 2, num_hidden_layers=layers,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, pad_token_id=1,
                   bos_token_id=3, eos_token_id=2,
                   rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0})
    if family == "qwen3_vl":
        text_kw.update(head_dim=hidden // 4, rope_parameters={"rope_type": "default", "mrope_section": [4, 2, 2],
                                                             "mrope_interleaved": True, "rope_theta": 10000.0})
    text_kw.update(text or {})
    vision_kw = dict(depth=2, num_heads=2, patch_size=VLM_PATCH, spatial_merge_size=2, temporal_patch_size=2)
    if family == "qwen2_5_vl":
        vision_kw.update(hidden_size=32, intermediate_size=64, out_hidden_size=hidden, window_size=4 * VLM_PATCH,
                         fullatt_block_indexes=[1])
    elif family == "qwen3_vl":
        vision_kw.update(hidden_size=32, intermediate_size=64, out_hidden_size=hidden, num_position_embeddings=16,
                         deepstack_visual_indexes=[0, 1])
    else:
        vision_kw.update(embed_dim=32, hidden_size=hidden, mlp_ratio=2)
    vision_kw.update(vision or {})
    ids = dict(image_token_id=vocab_size - 4, video_token_id=vocab_size - 3, vision_start_token_id=vocab_size - 2,
               vision_end_token_id=vocab_size - 1)
    ids.update(overrides)
    return getattr(transformers, VLM_FAMILIES[family][0])(text_config=text_kw, vision_config=vision_kw, **ids)


def build_tiny_vlm(family: str = "qwen2_5_vl", vocab_size: int = 80, seed: int = 0, **overrides):
    """A random-init tiny vision-language model of `family` in float32, in eval mode (no dropout)."""
    import transformers

    torch.manual_seed(seed)
    cls = getattr(transformers, VLM_FAMILIES[family][1])
    return cls(tiny_vlm_config(family, vocab_size, **overrides)).float().eval()


# Qwen2-VL's chat template, reduced to what the tests need: system/user/assistant turns, text and image parts (a
# string content is text). Image parts become the vision start, one image pad and the vision end, which the
# processor expands to the image's placeholder run.
TINY_VLM_TEMPLATE = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' }}"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for part in m['content'] %}"
    "{% if part['type'] == 'image' %}{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    "{{ '<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
TINY_VLM_TOKENS = ["<|im_start|>", "<|im_end|>"]
VISION_TOKENS = ["<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>"]  # the config's last 4 ids


# Qwen3-VL's image processor is Qwen2-VL's with pixels normalised to [-1, 1] (mean and deviation 0.5, where Qwen2-VL
# uses CLIP's statistics).
QWEN3_VL_PIXEL_STATS = {"image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]}


def tiny_vlm_processor(words: list[str] | None = None, vocab_size: int = 80, min_pixels: int = 16 * 16,
                       max_pixels: int = 64 * 64, patch_size: int = VLM_PATCH, merge_size: int = 2,
                       family: str = "qwen2_vl"):
    """A Qwen2-VL processor (Qwen3-VL's for `family` qwen3_vl) over a whitespace word tokenizer (no BOS: the chat
    template holds the specials) whose vision tokens have the ids `tiny_vlm_config` gives them (the last four of
    `vocab_size`; the ids between the words and them are unused fillers), and the PIL image processor with the
    tower's `patch_size`-pixel patches (the tiny tower's 4 by default) merged `merge_size` x `merge_size`: with the
    defaults an image resized to 8k x 8l pixels gives k l placeholder tokens. `min_pixels` / `max_pixels` bound the
    resized image's area."""
    import transformers
    from tokenizers import AddedToken
    from transformers import Qwen2VLImageProcessorPil

    from fastdpo.model.processor import QWEN_PROCESSORS, image_only_processor

    words = words if words is not None else ["user", "assistant", "system"] + [f"w{i}" for i in range(40)]
    base = len(SPECIALS) + len(TINY_VLM_TOKENS)
    if base + len(words) > vocab_size - len(VISION_TOKENS):
        raise ValueError(f"{len(words)} words do not fit a vocabulary of {vocab_size}.")
    filler = [f"<unused{i}>" for i in range(vocab_size - len(VISION_TOKENS) - base - len(words))]
    tok = word_tokenizer(TINY_VLM_TOKENS + words + filler, add_bos=False)
    tok.add_special_tokens({"additional_special_tokens": [AddedToken(t, special=True) for t in TINY_VLM_TOKENS
                                                           + VISION_TOKENS]})
    assert len(tok) == vocab_size and tok.convert_tokens_to_ids("<|image_pad|>") == vocab_size - 4
    stats = QWEN3_VL_PIXEL_STATS if family == "qwen3_vl" else {}
    images = Qwen2VLImageProcessorPil(patch_size=patch_size, merge_size=merge_size, temporal_patch_size=2,
                                      min_pixels=min_pixels, max_pixels=max_pixels, **stats)
    cls = getattr(transformers, QWEN_PROCESSORS["qwen3_vl" if family == "qwen3_vl" else "qwen2_vl"])
    return image_only_processor(cls, images, tok, TINY_VLM_TEMPLATE)


def build_tiny_vlm_dir(out_dir: str | Path, family: str = "qwen2_5_vl", vocab_size: int = 80, seed: int = 0,
                       **processor_kw) -> Path:
    """Save a tiny vision-language model (`build_tiny_vlm`) with its processor (`tiny_vlm_processor`) to `out_dir`,
    an HF model dir that `AutoProcessor.from_pretrained` and the model class load without downloads."""
    processor = tiny_vlm_processor(vocab_size=vocab_size, family=family, **processor_kw)
    return save_vlm_dir(out_dir, build_tiny_vlm(family, vocab_size, seed), processor)


def save_vlm_dir(out_dir: str | Path, model, processor) -> Path:
    """Save a vision-language model and its processor (tokenizer, image processor, chat template) to `out_dir`."""
    out = Path(out_dir)
    model.save_pretrained(out, safe_serialization=True)
    save_processor_parts(out, processor)
    return out


def save_processor_parts(out_dir: str | Path, processor) -> None:
    """Save the processor part by part (tokenizer, image processor, chat template): a processor without a video
    processor cannot save itself whole."""
    out = Path(out_dir)
    processor.tokenizer.save_pretrained(out)
    processor.image_processor.save_pretrained(out)
    (out / "chat_template.jinja").write_text(processor.chat_template, encoding="utf-8")


# A tiny LLaVA (llava-1.5 layout): a CLIP vision tower of 4-pixel patches over 16 x 16 pixel images (16 patches and
# the class token), its features from the last layer without the class token ("default"), so 16 image tokens per
# image; a 2-layer projector; a Llama language model. The image token takes the last id.
LLAVA_IMAGE_SIZE = 16
LLAVA_PATCH = 4
LLAVA_IMAGE_TOKENS = (LLAVA_IMAGE_SIZE // LLAVA_PATCH) ** 2
LLAVA_IMAGE_TOKEN = "<image>"

# The tiny Qwen2-VL template's turns, with an image part rendered as LLaVA's `<image>` tag (the processor expands it
# to the image's run of placeholder tokens).
TINY_LLAVA_TEMPLATE = TINY_VLM_TEMPLATE.replace("<|vision_start|><|image_pad|><|vision_end|>", LLAVA_IMAGE_TOKEN)


def tiny_llava_config(vocab_size: int = 80, hidden: int = 64, layers: int = 2, **overrides):
    """A tiny LlavaConfig: the CLIP tower above (2 layers of width 32), a Llama language model of `layers` layers
    with GQA; `initializer_range` goes to both towers, other `overrides` to the LlavaConfig (e.g.
    vision_feature_layer=-2)."""
    from transformers import LlavaConfig

    spread = {k: overrides.pop(k) for k in ("initializer_range",) if k in overrides}
    vision = dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=2, image_size=LLAVA_IMAGE_SIZE, patch_size=LLAVA_PATCH, projection_dim=32,
                  **spread)
    text = tiny_config("llama", vocab_size, hidden, layers, **spread).to_dict()
    kw = dict(image_token_index=vocab_size - 1, vision_feature_layer=-1, vision_feature_select_strategy="default",
              image_seq_length=LLAVA_IMAGE_TOKENS)
    kw.update(overrides)
    return LlavaConfig(vision_config=vision, text_config=text, **kw)


def build_tiny_llava(vocab_size: int = 80, seed: int = 0, **overrides):
    """A random-init tiny LLaVA model (`tiny_llava_config`) in float32, in eval mode (no dropout)."""
    from transformers import LlavaForConditionalGeneration

    torch.manual_seed(seed)
    return LlavaForConditionalGeneration(tiny_llava_config(vocab_size, **overrides)).float().eval()


def tiny_llava_processor(words: list[str] | None = None, vocab_size: int = 80):
    """A LlavaProcessor over a whitespace word tokenizer (no BOS: the chat template holds the specials) whose
    `<image>` token has the last id of `vocab_size` (`tiny_llava_config`'s image token), and the PIL CLIP image
    processor resizing and cropping every image to 16 x 16 pixels: 16 placeholder tokens per image."""
    from tokenizers import AddedToken
    from transformers import CLIPImageProcessorPil, LlavaProcessor

    words = words if words is not None else ["user", "assistant", "system"] + [f"w{i}" for i in range(40)]
    base = len(SPECIALS) + len(TINY_VLM_TOKENS)
    if base + len(words) > vocab_size - 1:
        raise ValueError(f"{len(words)} words do not fit a vocabulary of {vocab_size}.")
    filler = [f"<unused{i}>" for i in range(vocab_size - 1 - base - len(words))]
    tok = word_tokenizer(TINY_VLM_TOKENS + words + filler, add_bos=False)
    tok.add_special_tokens({"additional_special_tokens": [AddedToken(t, special=True) for t in TINY_VLM_TOKENS
                                                           + [LLAVA_IMAGE_TOKEN]]})
    assert len(tok) == vocab_size and tok.convert_tokens_to_ids(LLAVA_IMAGE_TOKEN) == vocab_size - 1
    images = CLIPImageProcessorPil(size={"shortest_edge": LLAVA_IMAGE_SIZE},
                                   crop_size={"height": LLAVA_IMAGE_SIZE, "width": LLAVA_IMAGE_SIZE})
    return LlavaProcessor(image_processor=images, tokenizer=tok, patch_size=LLAVA_PATCH,
                          vision_feature_select_strategy="default", num_additional_image_tokens=1,
                          chat_template=TINY_LLAVA_TEMPLATE)


def build_tiny_llava_dir(out_dir: str | Path, vocab_size: int = 80, seed: int = 0) -> Path:
    """Save a tiny LLaVA model (`build_tiny_llava`) with its processor (`tiny_llava_processor`: tokenizer, image
    processor, processor config, chat template) to `out_dir`, an HF model dir that `load_processor` and
    `AutoModelForImageTextToText` load without downloads."""
    out = Path(out_dir)
    build_tiny_llava(vocab_size, seed).save_pretrained(out, safe_serialization=True)
    tiny_llava_processor(vocab_size=vocab_size).save_pretrained(out)
    return out
