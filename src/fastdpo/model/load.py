"""Models in and out: devices and dtypes, tokenizers and models from local dirs or the hub (QLoRA bases quantised
while loading; custom code only with --trust_remote_code), LoRA adapters, and saving an HF dir or a PEFT adapter."""

from __future__ import annotations

import json
import logging
import os
import pickle
import shutil
from pathlib import Path

import torch

from fastdpo.errors import FastDPOError
from fastdpo.model.source import check_source, check_weight_files, custom_code_error, hub_snapshot, tokenizer_auto_map

log = logging.getLogger("fastdpo")


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise FastDPOError(f"--device {name}: no CUDA device is visible. Use --device cpu or check CUDA_VISIBLE_DEVICES.")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def _is_local(path: str) -> bool:
    return Path(path).exists() or path.startswith((".", "/", "~"))


def _adapter_base(p: Path) -> str:
    """The base model an adapter dir names in adapter_config.json ("" when unreadable)."""
    try:
        base = json.loads((p / "adapter_config.json").read_text(encoding="utf-8")).get("base_model_name_or_path")
    except (OSError, ValueError, AttributeError):
        return ""
    return base if isinstance(base, str) else ""


def adapter_given_as_model(path: str, flag: str = "model") -> FastDPOError | None:
    """The error for a LoRA adapter dir passed where a full model dir belongs; None when `path` is not one."""
    p = Path(path).expanduser()
    if not (p / "adapter_config.json").is_file() or (p / "config.json").is_file():
        return None
    base = _adapter_base(p)
    named = f" trained on {base}" if base else ""
    base = base or "BASE"
    if flag == "ref_model":
        fix = f"Pass --ref_adapters {path} instead (it is applied to --model, which must be {base})."
    else:
        fix = (f"Pass --model {base} --adapters {path} (fastdpo train also needs --train_type lora to go on "
               f"training it; --ref_adapters {path} makes it the reference instead).")
    return FastDPOError(f"--{flag} {path} is a LoRA adapter{named} (adapter_config.json, no config.json), not a "
                        f"full model. {fix}")


def load_tokenizer(path: str, trust_remote_code: bool = False, flag: str = "model"):
    """The tokenizer of a local HF dir or a hub id (a pad token set to eos when it has none); `flag` names the
    option `path` came from. Tokenizer code named in the model's auto_map runs only with `trust_remote_code`."""
    from transformers import AutoTokenizer

    if _is_local(path):
        p = Path(path).expanduser()
        if not p.is_dir():
            check_source(path, flag)  # a misspelt dir: says so, with a close match
            raise FastDPOError(f"--{flag} {path} is a file, not a model dir. Check --{flag}.")
        names = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
        if not any((p / n).exists() for n in names):
            if adapter := adapter_given_as_model(path):
                raise adapter
            raise FastDPOError(
                f"{path} has no tokenizer files ({', '.join(names)}). Save the tokenizer into the model dir "
                "(tokenizer.save_pretrained(dir))."
            )
    else:
        check_source(path, flag)
    _refuse_tokenizer_code(path, trust_remote_code)
    try:
        tok = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as e:
        raise FastDPOError(f"Cannot load a tokenizer from {path}: {str(e).splitlines()[0]}") from None
    except Exception as e:  # the model's own tokenizer code (trust_remote_code) may raise anything
        if not trust_remote_code:
            raise
        raise FastDPOError(f"The tokenizer code of {path} (run by --trust_remote_code) failed: {type(e).__name__}: "
                           f"{str(e).splitlines()[0] if str(e) else ''}. Check that code and what it needs installed."
                           ) from None
    _refuse_tokenizer_code(path, trust_remote_code)  # a hub tokenizer's config is local only now
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def _refuse_tokenizer_code(path: str, trust_remote_code: bool) -> None:
    local = Path(path).expanduser()
    where = local if local.is_dir() else hub_snapshot(path)
    named = tokenizer_auto_map(str(where)) if where is not None and not trust_remote_code else None
    if named:
        raise custom_code_error(path, named[0], named[1], "tokenizer", "a generic tokenizer built from its files")


def quantization_config(bits: int, device: torch.device, dtype: torch.dtype):
    """bitsandbytes settings for a QLoRA base: nf4 with double quantisation (4 bits), or LLM.int8 (8 bits)."""
    if device.type != "cuda":
        raise FastDPOError("--train_type qlora needs a CUDA GPU (bitsandbytes kernels). On CPU use --train_type lora.")
    try:
        import bitsandbytes  # noqa: F401
    except ImportError:
        raise FastDPOError("--train_type qlora needs bitsandbytes: pip install bitsandbytes") from None
    from transformers import BitsAndBytesConfig

    if bits == 4:
        return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                  bnb_4bit_compute_dtype=dtype, bnb_4bit_quant_storage=dtype)
    return BitsAndBytesConfig(load_in_8bit=True)


def _raised_from(e: BaseException | None, cls: type) -> bool:
    """Whether `e` or an exception it was raised from (or while handling) is a `cls`."""
    seen = set()
    while e is not None and id(e) not in seen:
        if isinstance(e, cls):
            return True
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return False


def _loads_onto(device: torch.device) -> bool:
    """transformers can place the weights on `device` as it reads them (device_map; before 5.0 that needs
    accelerate)."""
    if device.type != "cuda":
        return False
    import transformers

    if int(transformers.__version__.split(".")[0]) >= 5:
        return True
    import importlib.util

    return importlib.util.find_spec("accelerate") is not None


VISION_FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "llava")  # vision-language models fastdpo trains (`fastdpo.model.vlm`)


def is_vision_config(config) -> bool:
    """A vision-language model config of a family fastdpo trains (a vision tower beside the language model)."""
    return getattr(config, "vision_config", None) is not None and config.model_type in VISION_FAMILIES


# vision-language families next to one fastdpo trains, and what to use instead
VISION_NEIGHBOURS = {"qwen3_vl_moe": "Qwen3-VL's mixture-of-experts models are not trained; its dense models "
                                     "(model_type 'qwen3_vl', e.g. Qwen3-VL-8B-Instruct) are"}


def check_vision_family(config, path: str) -> None:
    """Refuse a vision-language model of a family fastdpo does not train: it would load and train as text, its
    image inputs and positions unread."""
    if getattr(config, "vision_config", None) is not None and config.model_type not in VISION_FAMILIES:
        note = VISION_NEIGHBOURS.get(config.model_type)
        raise FastDPOError(f"{path} is a vision-language model of model_type {config.model_type!r}, which fastdpo "
                           f"does not train yet (it trains {', '.join(VISION_FAMILIES)}): its image inputs and "
                           f"positions would not be read{f' ({note})' if note else ''}. Use a model of those families.")


def model_class(config):
    """The transformers auto class a config loads with: image-text-to-text for the vision-language families, a
    causal LM otherwise."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    return AutoModelForImageTextToText if is_vision_config(config) else AutoModelForCausalLM


def load_model(path: str, dtype: torch.dtype, device: torch.device, trust_remote_code: bool = False,
               model_type: str = "", quant_bits: int = 0, flag: str = "model"):
    """Load a causal LM from a local HF dir or a hub id, in `dtype`, on `device`, with SDPA attention;
    `quant_bits` 4 or 8 loads a quantised base for QLoRA. `flag` names the option `path` came from. Model code named
    in config.json's auto_map runs only with `trust_remote_code` (without it the load is refused)."""
    from safetensors import SafetensorError
    from transformers import AutoConfig

    quant = quantization_config(quant_bits, device, dtype) if quant_bits else None

    if _is_local(path):
        p = Path(path).expanduser()
        check_source(path, flag)
        if adapter := adapter_given_as_model(path, flag):
            raise adapter
        if not (p / "config.json").is_file():
            raise FastDPOError(f"{path} is not a model dir: config.json is missing. Check --{flag}.")
        check_weight_files(p)
    else:
        check_source(path, flag)
        if (snapshot := hub_snapshot(path)) is not None:
            check_weight_files(snapshot, path)
    try:
        config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as e:
        hint = " Pass --trust_remote_code true only if you trust that code." if "custom code" in str(e) else ""
        raise FastDPOError(f"Cannot read the model config of {path}: {str(e).splitlines()[0]}{hint}") from None
    auto_map = getattr(config, "auto_map", None)
    if auto_map and not trust_remote_code:
        raise custom_code_error(path, "config.json", dict(auto_map), "model",
                                f"the built-in {config.model_type} classes")
    if model_type and model_type != config.model_type:
        raise FastDPOError(
            f"--model_type {model_type!r} does not match {path}, whose config.json says {config.model_type!r}. "
            "Drop --model_type or point --model at the right model."
        )
    check_vision_family(config, path)
    try:
        extra = {"quantization_config": quant, "device_map": {"": device}} if quant else {}
        if not quant and _loads_onto(device):  # weights read straight onto the GPU: no CPU copy to move after
            extra = {"device_map": {"": device}}
        # use_kernels=False: transformers 5 kernelizes by default when the `kernels` package is present, fetching
        # layer code from the hub and rebinding each RMSNorm's forward on every .train(), which would undo ours
        model = model_class(config).from_pretrained(
            path, dtype=dtype, trust_remote_code=trust_remote_code, attn_implementation="sdpa", use_kernels=False,
            **extra
        )
    except SafetensorError as e:  # a hub download cut short (local dirs are checked above)
        if (snapshot := hub_snapshot(path)) is not None:
            check_weight_files(snapshot, path)
        raise FastDPOError(f"{path}: a safetensors weight file is damaged ({str(e).splitlines()[0]}). Copy or "
                           "download the model again.") from None
    except (OSError, ValueError, pickle.UnpicklingError) as e:
        # a .bin file holding more than tensors: torch.load(weights_only=True) refused it (transformers 4.x wraps
        # that refusal in an OSError)
        if _raised_from(e, pickle.UnpicklingError):
            raise FastDPOError(
                f"{path}: the PyTorch weight file holds objects other than tensors and was not loaded (it could run "
                "code). Use a model saved as safetensors."
            ) from None
        raise FastDPOError(f"Cannot load model weights from {path}: {str(e).splitlines()[0]}") from None
    except Exception as e:  # the model's own code (trust_remote_code), or torch on a damaged .bin file
        if trust_remote_code and not isinstance(e, (MemoryError, torch.OutOfMemoryError)):
            raise FastDPOError(f"The model code of {path} (run by --trust_remote_code) failed: {type(e).__name__}: "
                               f"{str(e).splitlines()[0] if str(e) else ''}. Check that code and what it needs "
                               "installed.") from None
        if isinstance(e, RuntimeError) and "zip archive" in str(e):
            raise FastDPOError(f"{path}: a PyTorch weight file is damaged or incomplete ({str(e).splitlines()[0]}). "
                               "Copy or download the model again.") from None
        raise
    return model if quant or _loads_onto(device) else model.to(device)


def check_adapter_dir(path: str, flag: str) -> Path:
    p = Path(path).expanduser()
    if not (p / "adapter_config.json").is_file():
        raise FastDPOError(f"{flag} {path}: not a PEFT adapter dir (adapter_config.json is missing). "
                           "Point it at a directory written by save_pretrained of a LoRA model.")
    return p


def add_lora(model, rank: int, alpha: int, dropout: float, target_modules: str, adapters: str = "",
             use_dora: bool = False, pattern: str | None = None):
    """Wrap `model` with a trainable LoRA adapter named "default": a fresh one (DoRA with `use_dora`), or the one
    saved in `adapters`. `pattern`: a regex of full module names to adapt instead of `target_modules`' names (a
    vision-language model's parts, `fastdpo.model.vlm_parts.lora_pattern`)."""
    from peft import LoraConfig, PeftModel, get_peft_model

    if adapters:
        return _name_base(PeftModel.from_pretrained(model, str(check_adapter_dir(adapters, "--adapters")),
                                                    is_trainable=True), model)
    if pattern is not None:
        targets = pattern
    elif target_modules in ("all-linear", "default"):
        targets = None if target_modules == "default" else target_modules  # None: PEFT's modules for the architecture
    else:
        targets = [t.strip() for t in target_modules.split(",")]
    cfg = LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=dropout, target_modules=targets, use_dora=use_dora,
                     task_type="CAUSAL_LM")
    try:
        return _name_base(get_peft_model(model, cfg), model)
    except ValueError as e:
        raise FastDPOError(f"--target_modules {target_modules!r}: {str(e).splitlines()[0]}") from None


def _name_base(peft_model, base):
    """A saved adapter names its base model (adapter_config.json), and infer and export without --model load that;
    a local base dir is named by its absolute path, so the name holds from any working directory."""
    where = Path(str(getattr(base, "name_or_path", "") or "")).expanduser()
    if where.is_dir():
        for c in peft_model.peft_config.values():
            c.base_model_name_or_path = str(where.resolve())
    return peft_model


def base_causal_lm(model):
    """The transformers CausalLM under a PEFT wrapper (or the model itself)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def decoder(model):
    lm = base_causal_lm(model)
    return lm.get_decoder() if hasattr(lm, "get_decoder") else lm.model


def model_summary(model) -> dict:
    lm = base_causal_lm(model)
    total = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return {"model_type": lm.config.model_type, "params": total, "trainable": trainable}


HOST_SHARE = 0.25  # the fast host copy only while the model takes at most this share of the host's free memory


def _host_free_bytes() -> int:
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):  # not on this platform: assume no room
        return 0


def host_state_dict(model, gpu_only: bool = True) -> dict | None:
    """The model's state dict copied to the CPU, fast: each copy lands in a zero-filled tensor, whose pages torch's
    parallel fill has faulted in, rather than in fresh memory the single-threaded copy faults in page by page (3.4 GB
    of a 1.7B model: about 0.6 s against 3.6 s for transformers' per-tensor `.cpu()`). Tensors that are one tensor
    on the device (tied embeddings) stay one on the CPU, so saving still drops the tied copy. None when there is
    nothing to copy (`gpu_only`: no tensor on a GPU), when the copy would take more than `HOST_SHARE` of the host's
    free memory (transformers then copies one tensor at a time), or when two entries are different views of one
    storage (left to transformers' own handling)."""
    state = model.state_dict()
    if gpu_only and not any(t.is_cuda for t in state.values()):
        return None
    nbytes = sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in state.values()}.values())
    if nbytes > HOST_SHARE * _host_free_bytes():
        return None
    copies: dict[tuple, torch.Tensor] = {}
    storages: dict[int, tuple] = {}
    out = {}
    for name, t in state.items():
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)
        if storages.setdefault(t.untyped_storage().data_ptr(), key) != key:
            return None
        if key not in copies:
            copies[key] = torch.zeros(t.shape, dtype=t.dtype).copy_(t.detach())
        out[name] = copies[key]
    return out


PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json", "video_preprocessor_config.json",
                   "chat_template.jinja", "chat_template.json")


def keep_processor_files(model, out: Path) -> None:
    """A vision-language model's processor files (image processor, chat template) copied from the dir it was loaded
    from into `out` beside the tokenizer, so the saved dir loads its processor as the original did."""
    lm = base_causal_lm(model)
    if not is_vision_config(lm.config):
        return
    source = Path(str(getattr(lm, "name_or_path", "") or "")).expanduser()
    if not source.is_dir():
        source = hub_snapshot(str(lm.name_or_path)) if lm.name_or_path else None
    if source is None or Path(source).resolve() == Path(out).resolve():
        return
    for name in PROCESSOR_FILES:
        if (Path(source) / name).is_file() and not (out / name).exists():
            shutil.copyfile(Path(source) / name, out / name)


def save_model(model, tokenizer, out: Path, state_dict: dict | None = None) -> None:
    """HF dir with safetensors (full) or a PEFT adapter dir (LoRA), plus the tokenizer. `state_dict`: full weights
    gathered from shards (FSDP2), saved instead of the model's own."""
    peft = hasattr(model, "peft_config")
    only_trained = {"selected_adapters": ["default"]} if peft else {}  # not a reference adapter
    if state_dict is None and not peft:  # a full model on a GPU: copied to the CPU at once, not tensor by tensor
        state_dict = host_state_dict(model)
    model.save_pretrained(out, safe_serialization=True, state_dict=state_dict, **only_trained)
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    keep_processor_files(model, out)
    (out / "fastdpo.json").write_text(json.dumps({"format": "fastdpo-model", "version": 1}))
