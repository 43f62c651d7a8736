"""`fastdpo verify --run DIR`: a finished run's certificate checked again on what it saved.

The run recorded, in its summary, the log-probs of the pairs its certificate checked, under its last weights and
under the reference it trained against (`certificate.record`). Here the saved model (`DIR/final`: the full model, or
LoRA adapters on the base model the run named) is loaded, the run's data read as the run read it, and those pairs
checked (`training.certificate.check_saved`): the saved model gives the recorded log-probs (nothing lost or altered
in the save), its fast path equals the plain path and its head a float32 head, the reference the run trained
against (a precomputed table included) equals a live forward of that reference now, and the saved policy differs
from it.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from fastdpo.errors import FastDPOError

log = logging.getLogger("fastdpo")


def verify_saved_run(run_dir: str, device: str = "", torch_dtype: str = ""):
    """The checks of `check_saved` on the run in `run_dir` (its --output_dir), on `device` and in `torch_dtype`
    (default: the run's). Returns the Certificate."""
    from fastdpo.checkpoint.saved_run import run_config
    from fastdpo.config import TrainConfig
    from fastdpo.dpo.reference import with_adapter_merged
    from fastdpo.model.load import load_model, load_tokenizer, resolve_device, resolve_dtype
    from fastdpo.model.processor import is_vision_model, load_processor
    from fastdpo.training.certificate import check_saved
    from fastdpo.training.setup import assemble, load_splits

    out = Path(run_dir).expanduser()
    record = saved_record(out)
    final = out / "final"
    trained, _ = run_config(str(final))
    if trained is None:
        raise FastDPOError(f"{final}: no saved training configuration (config.yaml) next to the model: `fastdpo verify "
                           "--run` needs the --output_dir of a fastdpo training run.")
    cfg = TrainConfig(**{**trained.to_dict(), "device": device or trained.device,
                         "torch_dtype": torch_dtype or trained.torch_dtype, "precompute_ref_log_probs": False,
                         "gradient_checkpointing": "none", "torch_compile": False, "streaming": False,
                         "adapters": str(final) if trained.uses_lora else ""})
    dev = resolve_device(cfg.device)
    dtype = resolve_dtype(cfg.torch_dtype, dev)
    tokenizer = load_tokenizer(cfg.model, cfg.trust_remote_code)
    vision = is_vision_model(cfg.model, cfg.trust_remote_code)  # rows with images read as training read them
    processor = load_processor(cfg.model, cfg.trust_remote_code) if vision else None
    _, pairs, _, _ = load_splits(cfg, tokenizer, processor=processor)
    pairs = recorded_pairs(pairs, record, cfg)
    quant = cfg.quant_bits if cfg.train_type == "qlora" else 0
    ref_model = None
    if cfg.uses_lora:
        model = load_model(cfg.model, dtype, dev, cfg.trust_remote_code, cfg.model_type, quant)
    else:
        model = load_model(str(final), dtype, dev, cfg.trust_remote_code, cfg.model_type)
        if cfg.needs_reference() and not cfg.ref_model:  # the reference was the starting model (or it with adapters)
            ref_model = load_model(cfg.model, dtype, dev, cfg.trust_remote_code, cfg.model_type)
            if cfg.ref_adapters:
                ref_model = with_adapter_merged(ref_model, cfg.ref_adapters)
    s = assemble(cfg, dev, model, tokenizer, pairs, ref_model=ref_model)
    return check_saved(s, pairs, record)


def saved_record(out: Path) -> dict:
    """The certificate's record in the run's summary.json, with what to do where there is none."""
    summary = out / "summary.json"
    if not (out / "final").is_dir() or not summary.is_file():
        raise FastDPOError(f"{out}: no final/ model or summary.json: `fastdpo verify --run` checks a finished run's "
                           "--output_dir (a run stopped early saved a checkpoint, not a final model; resume it to the "
                           "end first).")
    try:
        cert = json.loads(summary.read_text(encoding="utf-8")).get("certificate") or {}
    except (OSError, json.JSONDecodeError) as e:
        raise FastDPOError(f"{summary}: not readable as JSON ({e}).") from None
    if not cert.get("record"):
        raise FastDPOError(f"{summary}: the run recorded no certificate to check again: it trained with --certificate "
                           "off, streamed its data, or sharded its weights (FSDP2, sequence parallelism). `fastdpo "
                           "verify --model ... --dataset ...` checks the fast paths on any model.")
    return cert["record"]


def recorded_pairs(pairs: list, record: dict, cfg) -> list:
    """The pairs the run's certificate recorded, found by index in the run's data as read now; the data must have
    been read to the same tokens."""
    from fastdpo.training.certificate import completion_tokens

    by_index = {p.index: p for p in pairs}
    missing = [i for i in record["indices"] if i not in by_index]
    if missing:
        raise FastDPOError(f"rows {missing}, which the run's certificate recorded, are not in its data as read now "
                           f"({', '.join(cfg.dataset)}): the data changed since training. Check it against the run's "
                           "with the same files.")
    chosen = [by_index[i] for i in record["indices"]]
    tokens = completion_tokens(chosen)
    if tokens != record["tokens"]:
        raise FastDPOError(f"the recorded rows {record['indices']} read now to {tokens} completion tokens, the run read "
                           f"{record['tokens']}: the data, the tokenizer of {cfg.model} or its chat template changed "
                           "since training.")
    return chosen


def print_saved(cert, console, run_dir: str) -> None:
    for c in cert.checks:
        style = {"PASS": "green", "FAIL": "bold red", "SKIP": "yellow"}[c.status]
        console.print(c.line(), style=style, highlight=False, markup=False)
    console.print(f"{run_dir}: certificate {cert.status} ({cert.seconds:.1f} s)", highlight=False)
