"""TRL's DPO API on fastdpo: `from fastdpo import DPOConfig, DPOTrainer` in place of `from trl import ...`, the rest
of the script unchanged.

`DPOConfig` takes TRL's field names; those fastdpo has (the TrainConfig fields, and the other tools' names in
`fastdpo.config.compat`) are honoured, TRL's defaults apply where fastdpo's differ (learning rate, max_length, three
epochs), and a name fastdpo cannot honour is refused when the config is made. `DPOTrainer` takes TRL's constructor
arguments: a model name or a loaded model (trained as it is, not reloaded), a tokenizer, datasets in memory, a peft
LoraConfig. `train()` runs `fastdpo.train`; then `trainer.model` is the trained model.
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
from pathlib import Path
from typing import Any

from fastdpo.config import TrainConfig
from fastdpo.config.compat import FOREIGN, apply_foreign
from fastdpo.config.compat.base import adopt
from fastdpo.config.compat.trl import DEFAULTS as TRL_DEFAULTS
from fastdpo.errors import FastDPOError
from fastdpo.model.load import resolve_device, resolve_dtype, save_model
from fastdpo.training.callbacks import HOOKS
from fastdpo.training.loop import train
from fastdpo.training.result import TrainResult

log = logging.getLogger("fastdpo")
FIELDS = {f.name for f in dataclasses.fields(TrainConfig)}
TRL_OUTPUT_DIR = "trainer_output"  # HF TrainingArguments' default
# peft LoraConfig fields that change what trains, with the value fastdpo's adapters have
LORA_FIXED = {"use_rslora": False, "use_dora": False, "modules_to_save": None, "bias": "none",
              "layers_to_transform": None, "rank_pattern": {}, "alpha_pattern": {}, "init_lora_weights": True}


class DPOConfig:
    """TRL's DPOConfig by its field names (`output_dir`, `learning_rate`, `beta`, `loss_type`, `bf16`, ...). Each is
    checked now: a name fastdpo has no meaning for raises FastDPOError naming it. Read back as attributes."""

    def __init__(self, output_dir: str | None = None, **kwargs: Any):
        self.output_dir = output_dir or TRL_OUTPUT_DIR
        for name in kwargs:
            if name not in FIELDS and name not in FOREIGN:
                close = difflib.get_close_matches(name, sorted(FIELDS | set(FOREIGN)), n=1)
                hint = f" Did you mean {close[0]!r}?" if close else ""
                raise FastDPOError(f"DPOConfig({name}=...): fastdpo has no setting of this name, so it cannot honour "
                                   f"it.{hint} Drop it (the fastdpo names are the flags of `fastdpo train --help`).")
        self.given = dict(kwargs)
        self.__dict__.update(kwargs)

    def values(self) -> dict:
        """The TrainConfig fields these arguments give (TRL's defaults where fastdpo's differ and none is given)."""
        values = {k: v for k, v in self.given.items() if k in FIELDS}
        apply_foreign({k: v for k, v in self.given.items() if k not in FIELDS}, values)
        values["output_dir"] = self.output_dir
        defaults = {k: v for k, v in TRL_DEFAULTS.items() if k != "num_train_epochs" or values.get("max_steps", -1) <= 0}
        adopted = adopt(values, defaults)
        if adopted:
            log.info("DPOConfig: TRL's defaults for what it leaves out: %s.", ", ".join(adopted))
        if "gradient_checkpointing" in values:  # TRL's bool, fastdpo's policy names
            values["gradient_checkpointing"] = str(values["gradient_checkpointing"]).lower()
        if isinstance(values.get("target_modules"), (list, tuple, set)):
            values["target_modules"] = ",".join(map(str, values["target_modules"]))
        return values


def lora_fields(peft_config) -> dict:
    """A peft LoraConfig -> fastdpo's LoRA fields; what fastdpo's adapters cannot be is refused."""
    if type(peft_config).__name__ != "LoraConfig":
        raise FastDPOError(f"peft_config is a {type(peft_config).__name__}; fastdpo trains LoRA adapters only. Pass a "
                           "peft.LoraConfig, or drop peft_config for full fine-tuning.")
    for name, plain in LORA_FIXED.items():
        value = getattr(peft_config, name, plain)
        if value != plain and not (name == "use_dora" and "use_dora" in FIELDS):
            raise FastDPOError(f"peft_config: LoraConfig({name}={value!r}) is not available in fastdpo (its adapters "
                               f"have {name}={plain!r}). Drop that argument.")
    targets = peft_config.target_modules
    target = "default" if targets is None else targets if isinstance(targets, str) else ",".join(sorted(targets))
    out = {"train_type": "lora", "lora_rank": int(peft_config.r), "lora_alpha": peft_config.lora_alpha,
           "lora_dropout": float(peft_config.lora_dropout), "target_modules": target}
    if getattr(peft_config, "use_dora", False):
        out["use_dora"] = True
    return out


class DPOTrainer:
    """TRL's DPOTrainer constructor on fastdpo. `model`: a model name or dir, or a loaded PreTrainedModel (trained
    in place, on the configured device, in its own dtype unless DPOConfig names one); `ref_model`: None (the
    reference is the starting model, or the base without adapters under LoRA), a name or a loaded model;
    `processing_class`: the tokenizer (None: the model's); datasets: anything `TrainConfig(dataset=...)` takes."""

    def __init__(self, model, ref_model=None, args: DPOConfig | None = None, data_collator=None, train_dataset=None,
                 eval_dataset=None, processing_class=None, compute_metrics=None, callbacks: list | None = None,
                 optimizers=(None, None), quantization_config=None, peft_config=None):
        refused = {"data_collator": (data_collator, "fastdpo packs pairs itself (no padding)"),
                   "compute_metrics": (compute_metrics, "use callbacks' on_evaluate(step, metrics)"),
                   "optimizers": (None if optimizers in ((None, None), None) else optimizers,
                                  "fastdpo runs its own AdamW and schedule (set them in DPOConfig)"),
                   "quantization_config": (quantization_config, "use DPOConfig(load_in_4bit=True) with a peft_config")}
        for name, (value, why) in refused.items():
            if value is not None:
                raise FastDPOError(f"DPOTrainer({name}=...) is not supported: {why}. Drop it.")
        if train_dataset is None:
            raise FastDPOError("DPOTrainer needs train_dataset: rows with prompt/chosen/rejected (a Dataset, a list of "
                               "dicts, or a path).")
        if isinstance(eval_dataset, dict) and not type(eval_dataset).__name__.endswith("DatasetDict"):
            raise FastDPOError("eval_dataset as a dict of datasets: fastdpo evaluates one held-out set. Pass one.")
        if args is None:  # TRL's default: <model name>-DPO
            args = DPOConfig(f"{_model_name(model, 'model').rstrip('/').split('/')[-1]}-DPO")
        self.args = args
        self.model, self.processing_class = model, processing_class
        self.train_dataset, self.eval_dataset = train_dataset, eval_dataset
        self.callbacks = [_own_callback(cb) for cb in callbacks or []]
        values = self.args.values()
        values["model"] = _model_name(model, "model")
        if isinstance(ref_model, str) and ref_model == model:  # TRL's quick start names the model twice
            log.info("DPOTrainer: ref_model is the model's own name, so the reference is the starting model (as "
                     "with ref_model=None), not a second copy loaded from disk.")
            ref_model = None
        if ref_model is not None:
            if ref_model is model:
                raise FastDPOError("ref_model is the model itself: pass ref_model=None, and the reference is a frozen "
                                   "copy of the starting model.")
            values["ref_model"] = _model_name(ref_model, "ref_model")
        self.ref_model = ref_model
        if peft_config is not None:
            values.update(lora_fields(peft_config))
        if not isinstance(model, str) and not {"torch_dtype", "bf16", "fp16", "dtype"} & self.args.given.keys():
            values["torch_dtype"] = str(model.dtype).removeprefix("torch.")  # a loaded model trains as it is
        values["dataset"], values["val_dataset"] = train_dataset, eval_dataset if eval_dataset is not None else []
        self.config = TrainConfig(**values)
        self.result: TrainResult | None = None

    def train(self) -> TrainResult:
        """Train (the whole run, as `fastdpo train`); `self.model` is then the trained model, in eval mode."""
        loaded = {"model": None if isinstance(self.model, str) else self.model,
                  "ref_model": None if isinstance(self.ref_model, (str, type(None))) else self.ref_model,
                  "tokenizer": self.processing_class}
        if loaded["model"] is not None:
            _match_dtype(loaded["model"], self.config)
        tok = self.processing_class
        if tok is not None and getattr(tok, "pad_token_id", 0) is None:  # as a loaded tokenizer gets one
            tok.pad_token = tok.eos_token
        self.result = train(self.config, callbacks=self.callbacks, preloaded=loaded)
        self.model, self.processing_class = self.result.model, self.result.tokenizer
        return self.result

    def save_model(self, output_dir: str | None = None) -> None:
        """Save the model (the adapters under LoRA) and tokenizer, as TRL does; default: DPOConfig's output_dir."""
        if isinstance(self.model, str):
            raise FastDPOError(f"save_model: no model in memory yet ({self.model} loads when train() runs). Call "
                               "trainer.train() first.")
        out = Path(output_dir or self.args.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        save_model(self.model, self.processing_class, out)


def _model_name(model, arg: str) -> str:
    """The name set-up records for a model argument: the string, or where a loaded model came from."""
    if isinstance(model, str):
        return model
    if type(model).__name__.startswith("Peft"):
        raise FastDPOError(f"{arg} is a PEFT model: pass the base model and the LoraConfig as peft_config (fastdpo "
                           "adds the adapters), or merge the adapters first.")
    name = getattr(model, "name_or_path", "") or getattr(getattr(model, "config", None), "_name_or_path", "")
    if not name:
        raise FastDPOError(f"{arg} is a model object without a source dir or hub id (name_or_path is {name!r}); runs "
                           "record where their model came from. Save it with model.save_pretrained(DIR) and pass "
                           "the loaded model of DIR (or DIR itself).")
    return str(name)


def _match_dtype(model, cfg: TrainConfig) -> None:
    """A loaded model trains in the dtype the config names (bf16=True, torch_dtype): converted in place if needed."""
    dtype = resolve_dtype(cfg.torch_dtype, resolve_device(cfg.device))
    if model.dtype != dtype:
        log.info("DPOTrainer: the model given is %s; training it in %s as the config asks (converted in place).",
                 model.dtype, dtype)
        model.to(dtype)


def _own_callback(cb):
    """fastdpo's callbacks (functions, or objects with on_step / on_evaluate / on_save / ...); a transformers
    TrainerCallback's hooks take other arguments, so it is refused rather than misread."""
    if not any(c.__module__.split(".")[0] in ("transformers", "trl") for c in type(cb).__mro__):
        return cb
    raise FastDPOError(f"callbacks: {type(cb).__name__} looks like a transformers TrainerCallback, whose hooks fastdpo "
                       f"does not call. Write it with fastdpo's hooks: {', '.join(HOOKS)} (docs: Python API, "
                       "Callbacks).")
