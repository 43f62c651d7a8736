"""Reference log-probs (DESIGN §5). Strategies:

  none         reference-free losses (simpo, cpo, orpo, sft): no reference is loaded at all;
  precompute   one forward-only pass before training, cached on disk (refcache.py); no reference model is held
               while training;
  copy         a frozen copy of the policy (full fine-tuning);
  separate     a frozen --ref_model, or --model with --ref_adapters merged (full fine-tuning);
  adapter_off  LoRA: the policy itself with its adapters disabled, no second copy;
  ref_adapter  LoRA with --ref_adapters: that adapter, loaded frozen next to the trained one and switched on for the
               reference forward.
Online strategies run the same packed layout as the policy, without grad. TR-DPO (`sync`) updates copy / separate.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from fastdpo.config import TrainConfig
from fastdpo.data.load import Row
from fastdpo.data.pack import PairBatch
from fastdpo.data.tokenize import TokenizedPair
from fastdpo.data.vision_tokenize import PixelOptions
from fastdpo.dpo.refcache import (
    RefTable,
    cache_key,
    compute_table,
    data_fingerprint,
    default_cache_dir,
    load_table,
    model_fingerprint,
    save_table,
    tokens_fingerprint,
)
from fastdpo.errors import FastDPOError
from fastdpo.model.backend import Backend, micro_batch_budget, prepare_packed
from fastdpo.model.load import base_causal_lm, check_adapter_dir, load_model, resolve_device, resolve_dtype
from fastdpo.model.seqlogps import SeqLogps, completion_logps

log = logging.getLogger("fastdpo")
REF_ADAPTER = "ref"


@contextlib.contextmanager
def active_adapter(model, name: str):
    """Run with PEFT adapter `name` active (frozen), then switch back to the trained one."""
    previous = model.active_adapter
    model.set_adapter(name, inference_mode=True)
    try:
        yield
    finally:
        model.set_adapter(previous)


@dataclass
class Reference:
    strategy: str  # none | precompute | copy | separate | adapter_off | ref_adapter
    model: torch.nn.Module | None = None
    table: RefTable | None = None
    runner: Callable | None = None  # under FSDP2: (batch, mask) -> SeqLogps through the sharded module

    @property
    def online(self) -> bool:
        """Whether each training step runs a reference forward (for FLOP counts)."""
        return self.strategy not in ("none", "precompute")

    @torch.no_grad()
    def logps(self, policy, batch: PairBatch, backend: Backend, mask=None) -> SeqLogps | None:
        """Reference `SeqLogps` of the batch's sequences, or None when reference-free. The reference's log-probs
        are those of the completions only: a batch's prompt targets (ORPO's NLL) are left out."""
        if self.strategy == "none":
            return None
        if self.strategy == "precompute":
            return self.table.lookup(batch.index)
        if self.runner is not None:
            return self.runner(batch, mask)
        if self.strategy == "adapter_off":
            with policy.disable_adapter():
                return completion_logps(policy, batch, backend, mask, prompt=False)
        if self.strategy == "ref_adapter":
            with active_adapter(policy, REF_ADAPTER):
                return completion_logps(policy, batch, backend, mask, prompt=False)
        return completion_logps(self.model, batch, backend, mask, prompt=False)

    @torch.no_grad()
    def sync(self, policy, alpha: float) -> None:
        """TR-DPO (Gorbatovski et al. 2024): ref <- alpha * policy + (1 - alpha) * ref, parameter by parameter."""
        assert self.model is not None, f"TR-DPO needs a reference model, strategy is {self.strategy}"
        ref = dict(self.model.named_parameters())
        for name, p in base_causal_lm(policy).named_parameters():
            ref[name].lerp_(p.detach().to(ref[name].dtype), alpha)


@dataclass(frozen=True)
class Ranks:
    """The processes that share a precompute pass: this one is `rank` of `world`, and `gather` gives every rank's
    object in rank order (`parallel.objects.gather_objects` bound to the run's ranks: the reference sits below
    `parallel/`, so the caller passes the exchange in). The default is one process."""

    rank: int = 0
    world: int = 1
    gather: Callable[[Any], list[Any]] = lambda obj: [obj]


ONE_PROCESS = Ranks()


def _freeze(model: torch.nn.Module) -> torch.nn.Module:
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def with_adapter_merged(model, adapter_dir: str):
    """`model` with the LoRA adapter of `adapter_dir` merged into its weights (in place)."""
    from peft import PeftModel

    return PeftModel.from_pretrained(model, str(check_adapter_dir(adapter_dir, "--ref_adapters"))).merge_and_unload()


def load_ref_adapter(policy, adapter_dir: str) -> None:
    """Load --ref_adapters next to the trained LoRA adapter of `policy`, frozen (strategy ref_adapter)."""
    policy.load_adapter(str(check_adapter_dir(adapter_dir, "--ref_adapters")), adapter_name=REF_ADAPTER,
                        is_trainable=False)


def _check_same_shapes(ref, policy) -> None:
    want = {n: p.shape for n, p in policy.named_parameters()}
    have = {n: p.shape for n, p in ref.named_parameters()}
    if want != have:
        raise FastDPOError("--sync_ref_model mixes policy weights into the reference, so --ref_model must have the "
                           "same architecture and parameter names as --model.")


def build_reference(cfg: TrainConfig, policy, backend: Backend, pairs: list[TokenizedPair], rows: list[Row] | None,
                    pad_id: int, ref_model=None, ranks: Ranks = ONE_PROCESS) -> Reference:
    """Choose and build the strategy. `policy` must not yet carry the trained LoRA adapter: it is the reference's
    starting point for copy, adapter_off and precompute. `ref_model`: an already loaded --ref_model (else it is
    loaded here, and only if needed). `rows` key the precompute cache; None computes without caching. `ranks`
    share a precompute pass."""
    if not cfg.needs_reference():
        unused = [f"--{k}" for k in ("ref_model", "ref_adapters", "precompute_ref_log_probs") if getattr(cfg, k)]
        if unused:
            log.warning("--loss_type %s is reference-free: %s ignored, no reference loaded.", cfg.loss_type,
                        ", ".join(unused))
        return Reference("none")
    if cfg.precompute_ref_log_probs:
        table = precomputed_table(cfg, lambda: (policy, backend), pairs, rows, pad_id, ref_model, ranks)
        return Reference("precompute", table=table)
    if cfg.uses_lora and not cfg.ref_model and ref_model is None:
        return Reference("ref_adapter" if cfg.ref_adapters else "adapter_off")
    param = next(policy.parameters())
    if ref_model is not None or cfg.ref_model:
        model = ref_model or load_model(cfg.ref_model, param.dtype, param.device, cfg.trust_remote_code,
                                        flag="ref_model")
        strategy = "separate"
    else:
        model = copy.deepcopy(policy)
        strategy = "copy"
        if cfg.ref_adapters:
            model, strategy = with_adapter_merged(model, cfg.ref_adapters), "separate"
    _freeze(model)
    if cfg.sync_ref_model:
        _check_same_shapes(model, policy)
    if backend.name != "padded":
        prepare_packed(model, backend)
    return Reference(strategy, model)


def _free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def cache_path(cfg: TrainConfig, pairs: list[TokenizedPair], rows: list[Row]) -> tuple[Path, dict]:
    """Where the reference table of this model, data and tokenisation lives, and the fingerprints of its key."""
    cache_dir = Path(cfg.ref_cache_dir).expanduser() if cfg.ref_cache_dir else default_cache_dir()
    sources = [cfg.ref_model] if cfg.ref_model else [cfg.model] + ([cfg.ref_adapters] if cfg.ref_adapters else [])
    parts = {
        "model": model_fingerprint(sources, cache_dir),
        "data": data_fingerprint(rows),
        "tokenisation": tokens_fingerprint(pairs, cfg.max_length),
        "max_length": cfg.max_length,
        "dtype": str(resolve_dtype(cfg.torch_dtype, resolve_device(cfg.device))),
    }
    if cfg.fp8_base and not cfg.ref_model:  # the pass ran on the FP8 base (a --ref_model keeps its own precision)
        parts["base"] = "fp8_e4m3_rowwise"
    if cfg.fp8 and not cfg.ref_model:  # the pass ran the policy's FP8 products (--fp8)
        parts["products"] = f"fp8_e4m3_{cfg.fp8_recipe}"
    if any(r.images for r in rows):  # the size images were resized to (flags or environment)
        pixels = PixelOptions.resolve(cfg.max_pixels or None, cfg.min_pixels or None)
        parts["pixels"] = [pixels.max_pixels, pixels.min_pixels]
    return cache_dir / f"{cache_key(parts)}.safetensors", parts


def precomputed_table(cfg: TrainConfig, get_policy: Callable[[], tuple[torch.nn.Module, Backend]],
                      pairs: list[TokenizedPair], rows: list[Row] | None, pad_id: int, ref_model=None,
                      ranks: Ranks = ONE_PROCESS) -> RefTable:
    """The reference table from the on-disk cache, or computed and cached. `get_policy` gives the policy (before
    LoRA) and its backend; it is called only when the cache misses. Without `rows` (a model built in memory) or
    with a `ref_model` given in memory, nothing identifies the weights on disk: computed, not cached.
    Under torchrun (`ranks` with several) each rank computes every world_size-th pair and the shares are
    exchanged, so the pass takes 1/world_size of the time; rank 0 writes the cache."""
    device = resolve_device(cfg.device)
    world, rank = ranks.world, ranks.rank
    path, parts = cache_path(cfg, pairs, rows) if rows is not None and ref_model is None else (None, {})
    table = load_table(path, device) if path is not None else None
    hit = table is not None and set(table.index.tolist()) >= {p.index for p in pairs}
    if all(ranks.gather(hit)):  # ranks decide together: one computing alone would leave the others waiting
        log.info("Reference log-probs reused from %s.", path)
        return table

    log.info("Precomputing reference log-probs of %d pairs%s%s.", len(pairs), f" into {path}" if path else "",
             f" ({world} ranks, each a share)" if world > 1 else "")
    table = _compute(cfg, get_policy, pairs[rank::world], pad_id, ref_model, device)
    if world > 1:
        shares = ranks.gather((table.index, table.values))
        table = RefTable(torch.cat([i for i, _ in shares]), torch.cat([v for _, v in shares]), device)
    if path is not None and rank == 0:
        save_table(path, table, {**parts, "pairs": len(pairs)})
    return table


def _compute(cfg: TrainConfig, get_policy, pairs: list[TokenizedPair], pad_id: int, ref_model, device) -> RefTable:
    policy, backend = get_policy()
    batch_pairs = cfg.precompute_ref_batch_size or 4 * cfg.per_device_train_batch_size
    # four times the training budget (no backward here); `fastdpo precompute` without one sizes it as training would
    budget = 4 * micro_batch_budget(backend, cfg.max_tokens_per_batch, pairs, cfg.per_device_train_batch_size)
    param = next(policy.parameters())
    if ref_model is not None or cfg.ref_model:
        model = _freeze(ref_model or load_model(cfg.ref_model, param.dtype, param.device, cfg.trust_remote_code,
                                                flag="ref_model"))
        ref_model = None  # drop the caller's reference too: only the table outlives this pass
        if backend.name != "padded":
            prepare_packed(model, backend)
        table = compute_table(model, pairs, backend, pad_id, device, batch_pairs, budget)
        del model
        _free_memory()
    elif cfg.ref_adapters:
        from peft import PeftModel

        wrapped = PeftModel.from_pretrained(policy, str(check_adapter_dir(cfg.ref_adapters, "--ref_adapters")))
        if backend.name != "padded":
            prepare_packed(wrapped, backend)
        table = compute_table(wrapped, pairs, backend, pad_id, device, batch_pairs, budget)
        wrapped.unload()  # the policy's own modules back, unchanged
    else:
        if backend.name != "padded":
            prepare_packed(policy, backend)
        table = compute_table(policy, pairs, backend, pad_id, device, batch_pairs, budget)
    return table
