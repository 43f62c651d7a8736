"""Shared by the tests of vision-language model dirs (tiny Qwen2.5-VL and Qwen3-VL,
`fastdpo.model.tiny.build_tiny_vlm_dir`, and tiny LLaVA, `build_tiny_llava_dir`): rows with images, a random LoRA
adapter, the model's own forward of a pair."""

from pathlib import Path

import torch
from data_helpers import write_image

from fastdpo.model.tiny import build_tiny_llava_dir, build_tiny_vlm_dir

VLM_DIR_FAMILIES = ["qwen2_5_vl", "qwen3_vl", "llava"]


def build_vlm_dir(out_dir: Path, family: str) -> Path:
    """A tiny vision-language model dir of `family` (Qwen2-VL kinds or llava) with its processor."""
    return build_tiny_llava_dir(out_dir) if family == "llava" else build_tiny_vlm_dir(out_dir, family)


def vision_prefixes(family: str) -> tuple[str, tuple[str, ...]]:
    """(vision tower, aligner) prefixes of the saved weights' names: the aligner's names start with the tower's for
    Qwen (its mergers are inside the tower; Qwen3-VL's DeepStack mergers are the aligner's too, and it saves its
    weights under `model.`)."""
    if family == "llava":
        return "vision_tower.", ("multi_modal_projector.",)
    if family == "qwen3_vl":
        return "model.visual.", ("model.visual.merger.", "model.visual.deepstack_merger_list.")
    return "visual.", ("visual.merger.",)


def image_rows(root: Path, colors=((200, 30, 30), (30, 200, 30), (30, 30, 200), (200, 200, 30))) -> list[dict]:
    """Four ms-swift rows: images of two sizes (one pair with two, one with none), prompts and completions of other
    lengths."""
    paths = [write_image(root / "img" / f"{i}.png", 16 + 8 * (i % 2), 16, c) for i, c in enumerate(colors)]
    return [
        {"messages": [{"role": "user", "content": "<image>w1 w2"}, {"role": "assistant", "content": "w5 w6"}],
         "rejected_response": "w7", "images": [str(paths[0])]},
        {"messages": [{"role": "user", "content": "w3 <image>w4 <image>"}, {"role": "assistant", "content": "w8"}],
         "rejected_response": "w9 w10 w11", "images": [str(paths[1]), str(paths[2])]},
        {"messages": [{"role": "user", "content": "w12 w13"}, {"role": "assistant", "content": "w14 w15"}],
         "rejected_response": "w16"},
        {"messages": [{"role": "user", "content": "<image>w17"}, {"role": "assistant", "content": "w18 w19 w20"}],
         "rejected_response": "w21 w22", "images": [str(paths[3])]},
    ]


def random_vlm_adapter(base_dir: Path, out_dir: Path, seed: int = 0) -> Path:
    """A LoRA adapter with random (non-zero) A and B on every linear layer of the language model: a change large
    enough to see in logits and greedy tokens."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForImageTextToText

    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_pretrained(base_dir)
    cfg = LoraConfig(r=4, lora_alpha=16, target_modules=r".*language_model.*\.(q_proj|k_proj|v_proj|o_proj|gate_proj|"
                     r"up_proj|down_proj)", init_lora_weights=False)
    get_peft_model(model, cfg).save_pretrained(out_dir)
    return out_dir


def sequence_logp(model, pair, completion) -> torch.Tensor:
    """The model's own forward of [prompt | completion] (its processor's inputs; Qwen: mm_token_type_ids included),
    full float32 logits: the completion's log-prob sum."""
    ids = torch.tensor([pair.prompt + completion])
    llava = model.config.model_type == "llava"
    kw = {} if llava else {"mm_token_type_ids": (ids == model.config.image_token_id).int()}
    if pair.num_images:
        kw["pixel_values"] = pair.pixel_values
        if not llava:
            kw["image_grid_thw"] = pair.image_grid_thw
    logits = model(input_ids=ids, use_cache=False, **kw).logits[0].float()
    return torch.log_softmax(logits[:-1], -1).gather(1, ids[0, 1:, None])[len(pair.prompt) - 1:, 0].sum()
