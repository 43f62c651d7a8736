"""Which parts of a vision-language model (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, LLaVA) train, with ms-swift's names:

  vit      the vision tower: its patch embedding and blocks (Qwen: `model.visual` but the mergers;
           LLaVA: `model.vision_tower`)                                                          --freeze_vit (true)
  aligner  what projects image features into the language model (Qwen: the patch merger, and Qwen3-VL's
           DeepStack mergers `deepstack_merger_list`; LLaVA: `model.multi_modal_projector`)     --freeze_aligner (true)
  llm      the language model and its output head                                              --freeze_llm (false)

Full fine-tuning trains the weights of the parts not frozen (`freeze_parts`). LoRA puts adapters on the linear
layers of those parts only (`lora_pattern`: in the language model, the layers --target_modules names; in the vision
tower and the mergers, all of their linear layers), so by default the vision tower carries none.
"""

from __future__ import annotations

import re

import torch

from fastdpo.errors import FastDPOError
from fastdpo.model.load import base_causal_lm

PEFT_DEFAULT = ("q_proj", "v_proj")  # PEFT's modules for the Qwen2 language model (target_modules "default")


def vision_tower(model) -> tuple[torch.nn.Module, list[torch.nn.Module]] | None:
    """(the vision tower, the modules that project its features into the language model) of a vision-language
    model (Qwen: `model.visual`, whose mergers sit inside it; LLaVA: `model.vision_tower` and
    `model.multi_modal_projector`); None for a text model."""
    inner = getattr(base_causal_lm(model), "model", None)
    if hasattr(inner, "visual"):
        visual = inner.visual
        return visual, [visual.merger] + ([visual.deepstack_merger_list] if hasattr(visual, "deepstack_merger_list")
                                          else [])
    if hasattr(inner, "vision_tower"):
        return inner.vision_tower, [inner.multi_modal_projector]
    return None


def parts(model) -> dict[str, list[tuple[str, torch.nn.Module]]]:
    """{part: [(full module name, module)]} of the model's vit, aligner and llm; lm_head is the llm's."""
    lm = base_causal_lm(model)
    visual, mergers = vision_tower(model)
    language = lm.model.language_model
    names = {id(m): n for n, m in lm.named_modules()}
    out: dict[str, list] = {"vit": [], "aligner": [], "llm": [(names[id(lm.lm_head)], lm.lm_head)]}
    out["aligner"] += [(names[id(m)], m) for m in mergers]
    out["llm"].append((names[id(language)], language))
    out["vit"] += [(names[id(m)], m) for m in visual.children() if all(m is not x for x in mergers)]
    return out


def trained_parts(freeze_vit: bool, freeze_aligner: bool, freeze_llm: bool) -> list[str]:
    wanted = [name for name, frozen in (("vit", freeze_vit), ("aligner", freeze_aligner), ("llm", freeze_llm))
              if not frozen]
    if not wanted:
        raise FastDPOError("--freeze_vit, --freeze_aligner and --freeze_llm together freeze the whole model: nothing "
                           "would train. Set --freeze_llm false (or another of them).")
    return wanted


def freeze_parts(model, freeze_vit: bool = True, freeze_aligner: bool = True, freeze_llm: bool = False) -> list[str]:
    """Full fine-tuning: the frozen parts' parameters stop taking gradients; returns the parts that train."""
    wanted = trained_parts(freeze_vit, freeze_aligner, freeze_llm)
    for part, modules in parts(model).items():
        if part not in wanted:
            for _, module in modules:
                module.requires_grad_(False)
    return wanted


def lora_pattern(model, target_modules: str, freeze_vit: bool = True, freeze_aligner: bool = True,
                 freeze_llm: bool = False) -> str:
    """A PEFT `target_modules` regex (matched against full module names) of the linear layers LoRA adapts: in the
    language model, those `target_modules` names (all-linear: all but the head; default: PEFT's q_proj, v_proj; else
    the comma-separated names); in an unfrozen vision tower or its mergers, all of their linear layers."""
    wanted = trained_parts(freeze_vit, freeze_aligner, freeze_llm)
    names = None
    if target_modules == "default":
        names = set(PEFT_DEFAULT)
    elif target_modules != "all-linear":
        names = {t.strip() for t in target_modules.split(",") if t.strip()}
    chosen: list[str] = []
    for part, modules in parts(model).items():
        if part not in wanted:
            continue
        for root, module in modules:
            if part == "llm" and module is base_causal_lm(model).lm_head:
                continue  # the output head keeps full weights under LoRA, as for text models
            for name, sub in module.named_modules():
                if not isinstance(sub, torch.nn.Linear):
                    continue
                leaf = name.rsplit(".", 1)[-1]
                if part == "llm" and names is not None and leaf not in names:
                    continue
                chosen.append(f"{root}.{name}" if name else root)
    if not chosen:
        raise FastDPOError(f"--target_modules {target_modules!r} names no linear layer of the parts that train "
                           f"({', '.join(wanted)}). Use all-linear or names such as q_proj,v_proj.")
    # one alternative per (part root, leaf name): short, and exact for these models' layer names
    groups: dict[str, set[str]] = {}
    for full in chosen:
        root = next(r for p in wanted for r, _ in parts(model)[p] if full == r or full.startswith(r + "."))
        groups.setdefault(root, set()).add(full.rsplit(".", 1)[-1])
    alternatives = [rf"{re.escape(root)}\.(?:.*\.)?(?:{'|'.join(sorted(map(re.escape, leaves)))})"
                    for root, leaves in sorted(groups.items())]
    pattern = "|".join(f"(?:{a})" for a in alternatives)
    matched = {n for n, _ in base_causal_lm(model).named_modules() if re.fullmatch(pattern, n)}
    if matched != set(chosen):  # a layer name shared with another module: name every layer instead
        pattern = "|".join(map(re.escape, sorted(chosen)))
    return pattern
