"""`fastdpo precompute-ref`: build the reference log-prob cache ahead of training, from the same flags as train."""

from __future__ import annotations

import dataclasses

from fastdpo.config import TrainConfig
from fastdpo.dpo.reference import cache_path, precomputed_table
from fastdpo.errors import FastDPOError
from fastdpo.model.backend import choose_backend
from fastdpo.model.load import load_model, load_tokenizer, resolve_device, resolve_dtype
from fastdpo.model.processor import is_vision_model, load_processor
from fastdpo.training.setup import check_vision_flags, load_splits, pad_id, seed_all


def precompute_ref(cfg: TrainConfig) -> dict:
    """Compute (or find) the cached reference log-probs that `fastdpo train --precompute_ref_log_probs` will use."""
    cfg = dataclasses.replace(cfg, precompute_ref_log_probs=True)
    cfg.validate()
    if not cfg.needs_reference():
        raise FastDPOError(f"--loss_type {cfg.loss_type} is reference-free: there is nothing to precompute.")
    device = resolve_device(cfg.device)
    dtype = resolve_dtype(cfg.torch_dtype, device)
    seed_all(cfg.seed)
    tokenizer = load_tokenizer(cfg.model, cfg.trust_remote_code)
    vision = is_vision_model(cfg.model, cfg.trust_remote_code)  # rows with images are read as training reads them
    check_vision_flags(cfg, vision)
    processor = load_processor(cfg.model, cfg.trust_remote_code) if vision else None
    rows, pairs = load_splits(cfg, tokenizer, processor=processor)[:2]
    path, _ = cache_path(cfg, pairs, rows)
    existed = path.is_file()

    def get_policy():
        model = load_model(cfg.model, dtype, device, cfg.trust_remote_code, cfg.model_type)
        return model, choose_backend(model, cfg.attn_impl, cfg.padding_free, device, cfg.length_buckets)

    precomputed_table(cfg, get_policy, pairs, rows, pad_id(tokenizer))
    return {"path": str(path), "pairs": len(pairs), "reused": existed}
