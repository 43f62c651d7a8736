"""`fastdpo export --merge_lora`: fold a LoRA adapter into its base model and write a standalone HF model dir
(safetensors, tokenizer, generation config; a vision-language model's processor files too) that generates exactly what
base + adapter generates."""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

from fastdpo.config import DTYPES
from fastdpo.config.fields import Section, check_choice, option
from fastdpo.config.sections.generation import base_of_adapter
from fastdpo.config.sections.output import HubSection
from fastdpo.errors import FastDPOError
from fastdpo.model.upload import hub_repo, push_folder


@dataclass
class ExportSection(Section):
    """Which adapter is merged into which base, and where the merged model goes."""

    name = "export"
    title = "Model and output"

    model: str = option("", "Base model the adapter was trained on: local HF model dir or hub id (default: the one its "
                        "adapter_config.json names).")
    adapters: str = option("", "PEFT adapter dir (a LoRA run's output_dir/final or checkpoint-N).")
    merge_lora: bool = option(False, "Merge the adapter into the base weights (the export this command performs).")
    output_dir: str = option("", "New directory for the merged model (default: the adapter dir's path + -merged, as "
                             "ms-swift names it).")
    torch_dtype: str = option("auto", "dtype of the merged weights: auto (the base's stored dtype)|float32|bfloat16|float16.")
    trust_remote_code: bool = option(False, "Allow model code from the model dir / hub (off unless asked).")

    def validate_export(self) -> None:
        if not self.adapters:
            raise FastDPOError("--adapters is required: the LoRA adapter dir to merge.")
        if not self.model:
            self.model = base_of_adapter(self.adapters, "adapters")
        if not self.merge_lora:
            raise FastDPOError("Nothing to export: add --merge_lora to fold the adapter into the base weights.")
        if not self.output_dir:  # ms-swift's default: next to the adapter
            self.output_dir = str(Path(self.adapters.rstrip("/\\")).expanduser()) + "-merged"
        check_choice("torch_dtype", self.torch_dtype, DTYPES)
        out = Path(self.output_dir).resolve()
        for name, src in (("--model", self.model), ("--adapters", self.adapters)):
            if Path(src).exists() and Path(src).resolve() == out:
                raise FastDPOError(f"--output_dir is the same directory as {name}; choose a new one.")
        if out.exists() and any(out.iterdir()):
            raise FastDPOError(f"--output_dir {self.output_dir} exists and is not empty; choose a new directory.")


@dataclass
class ExportConfig(HubSection, ExportSection):
    """`fastdpo export`: a LoRA adapter merged into its base, saved, and uploaded (`HubSection`, as training's)."""

    def validate(self) -> None:
        self.validate_export()
        self.validate_hub()


def merge_lora(cfg: ExportConfig, console=None) -> Path:
    """Load base + adapter on the CPU, merge, save atomically into cfg.output_dir; returns the directory."""
    import torch

    from fastdpo.model.generate import has_tokenizer, load_adapter
    from fastdpo.model.load import keep_processor_files, load_model, load_tokenizer

    cfg.validate()
    tokenizer = load_tokenizer(cfg.adapters if has_tokenizer(cfg.adapters) else cfg.model, cfg.trust_remote_code)
    if cfg.torch_dtype == "auto":
        dtype = _stored_dtype(cfg.model, cfg.trust_remote_code)
    else:
        dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[cfg.torch_dtype]
    base = load_model(cfg.model, dtype, torch.device("cpu"), cfg.trust_remote_code)
    peft_model = load_adapter(base, cfg.adapters)
    merged = peft_model.merge_and_unload()
    merged.eval()

    out = Path(cfg.output_dir)
    tmp = out.with_name(f".{out.name}.tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    merged.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    keep_processor_files(merged, tmp)  # a vision-language base: its image processor and chat template
    if not (tmp / "generation_config.json").exists() and getattr(merged, "generation_config", None) is not None:
        merged.generation_config.save_pretrained(tmp)
    (tmp / "fastdpo.json").write_text(json.dumps({"format": "fastdpo-model", "version": 1, "merged_from": {
        "model": cfg.model, "adapters": cfg.adapters}}, indent=1))
    if out.exists():
        out.rmdir()  # validated empty
    tmp.rename(out)
    if console is not None:
        console.print(f"wrote {out}: a copy of {cfg.model} with the adapter {cfg.adapters} merged into its weights "
                      f"({cfg.model} is unchanged).", markup=False, highlight=False, soft_wrap=True)
    if cfg.push_to_hub:
        url = push_folder(out, hub_repo(cfg.hub_model_id, cfg.output_dir), cfg.hub_private_repo, "merged model")
        if console is not None:
            console.print(f"uploaded {out} to {url}", markup=False, highlight=False, soft_wrap=True)
    return out


def _stored_dtype(path: str, trust_remote_code: bool):
    """The torch dtype the base's config says its weights are stored in (float32 when it does not say)."""
    import torch
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError):
        return torch.float32  # load_model reports the problem
    dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None)
    return dtype if isinstance(dtype, torch.dtype) else torch.float32
