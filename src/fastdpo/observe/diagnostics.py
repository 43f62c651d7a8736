"""Turn a CUDA out-of-memory error into a message a user can act on: what was asked for, the peak seen, the settings
that drive memory, and concrete next steps, most effective first (telling an OOM from a hang)."""

from __future__ import annotations

import dataclasses
import os
import re

import torch

from fastdpo.config import checkpoint_policy
from fastdpo.errors import FastDPOError


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def memory_facts(device: torch.device | None) -> str:
    """Peak and current allocation on a CUDA device, or a note that none was in use."""
    if device is None or device.type != "cuda" or not torch.cuda.is_available():
        return "Peak memory: not measured (no CUDA device in use)."
    props = torch.cuda.get_device_properties(device)
    return (f"Peak allocated {_gib(torch.cuda.max_memory_allocated(device))} of {_gib(props.total_memory)} on "
            f"{props.name} ({_gib(torch.cuda.memory_reserved(device))} reserved by the caching allocator).")


def reference_strategy(cfg) -> str:
    """Which reference sits in memory while training (as the settings imply)."""
    if getattr(cfg, "precompute_ref_log_probs", False):
        return "precomputed"
    if cfg.ref_model:
        return "separate"
    if getattr(cfg, "ref_adapters", ""):
        return "adapters"
    return "adapter_off" if cfg.train_type in ("lora", "qlora") else "copy"


def oom_next_steps(cfg, longest_micro_tokens: int | None, plan=None) -> list[str]:
    """Concrete changes, most effective first, that apply to these settings (`plan`: the run's resolved
    checkpointing and token budget, when set-up got that far)."""
    steps = []
    plan = plan or cfg
    budget = plan.max_tokens_per_batch
    if budget:
        steps.append(f"--max_tokens_per_batch {max(16, budget // 2)} (now {budget}): fewer tokens per micro-batch; "
                     "the optimizer step still covers the same pairs.")
    elif longest_micro_tokens:
        steps.append(f"--max_tokens_per_batch {max(16, longest_micro_tokens // 2)}: this step's largest micro-batch "
                     f"had {longest_micro_tokens} tokens; a budget caps it without changing the pairs per step.")
    else:
        steps.append(f"a smaller --per_device_train_batch_size (now {cfg.per_device_train_batch_size}) with a larger "
                     "--gradient_accumulation_steps, or a --max_tokens_per_batch budget.")
    try:
        policy, _ = checkpoint_policy(plan.gradient_checkpointing)
    except FastDPOError:  # `auto`: resolved at start; the next step down is still `full`
        policy = "auto"
    if policy == "none":
        steps.append("--gradient_checkpointing ffn (MLP activations recomputed, small slowdown) or full (lowest "
                     "activation memory).")
    elif policy != "full":
        steps.append(f"--gradient_checkpointing full (now {plan.gradient_checkpointing}).")
    fields = {f.name for f in dataclasses.fields(cfg)}
    if reference_strategy(cfg) in ("copy", "separate"):
        flag = " (--precompute_ref_log_probs)" if "precompute_ref_log_probs" in fields else ""
        steps.append(f"precompute the reference log-probs{flag}: the frozen reference model then leaves memory.")
    if cfg.train_type == "full":
        steps.append("--train_type lora (the reference is the same model with adapters off, no second copy, and "
                     "optimizer state only for the adapters), or --train_type qlora to also quantise the base weights.")
    elif cfg.train_type == "lora":
        fp8 = "" if getattr(cfg, "fp8_base", False) else (", or --fp8_base: its decoder projections in FP8, half "
                                                           "their bf16 bytes (Ada/Hopper GPUs)")
        steps.append(f"--train_type qlora --quant_bits 4: the frozen base weights in 4 bits (CUDA){fp8}.")
    if cfg.torch_dtype == "float32":
        steps.append("--torch_dtype bfloat16 (half the memory of float32 weights and activations).")
    if cfg.max_length > 1024:
        steps.append(f"a lower --max_length (now {cfg.max_length}) if your pairs allow it.")
    return steps


def fragmented(message: str) -> str | None:
    """The memory torch's out-of-memory `message` says was reserved but unallocated, when that is at least 1 GiB and
    the allocator does not already grow its segments in place (`expandable_segments`); else None."""
    found = re.search(r"([\d.]+) ([KMGT])iB is reserved by PyTorch but unallocated", message)
    if found is None:
        return None
    size = float(found.group(1)) * 2 ** (10 * "KMGT".index(found.group(2)) + 10)
    settings = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "") + os.environ.get("PYTORCH_ALLOC_CONF", "")
    if size < 2**30 or "expandable_segments:true" in settings.replace(" ", "").lower():
        return None
    return f"{found.group(1)} {found.group(2)}iB"


def oom_error(e: BaseException, cfg, device: torch.device | None, step_pairs=None, plan=None) -> FastDPOError:
    """A FastDPOError explaining out-of-memory error `e` raised while training with `cfg` (and the run's resolved
    `plan`, once set-up made one)."""
    resolved = plan or cfg
    first = str(e).strip().splitlines()[0] if str(e).strip() else "out of memory"
    asked = re.search(r"Tried to allocate ([\d.]+ [KMGT]iB)", str(e))
    longest_micro = None
    where = "while loading the models (before the first step)"
    if step_pairs:
        from fastdpo.data.pack import split_micro_batches

        groups = split_micro_batches(step_pairs, resolved.max_tokens_per_batch, cfg.per_device_train_batch_size)
        longest_micro = max(sum(p.num_tokens for p in g) for g in groups)
        where = (f"in a step of {len(step_pairs)} pairs (longest pair {max(p.num_tokens for p in step_pairs)} tokens, "
                 f"largest micro-batch {longest_micro} tokens)")
    settings = (f"per_device_train_batch_size {cfg.per_device_train_batch_size}, gradient_accumulation_steps "
                f"{cfg.gradient_accumulation_steps}, max_tokens_per_batch {resolved.max_tokens_per_batch}, max_length "
                f"{cfg.max_length}, gradient_checkpointing {resolved.gradient_checkpointing}, train_type {cfg.train_type}, "
                f"reference {reference_strategy(cfg)}, torch_dtype {cfg.torch_dtype}")
    lines = [f"Out of GPU memory {where}" + (f": tried to allocate {asked.group(1)}." if asked else f": {first}"),
             memory_facts(device), f"Settings: {settings}.", "Next steps, most effective first:"]
    steps = oom_next_steps(cfg, longest_micro, plan)
    loose = fragmented(str(e))
    if loose is not None:
        steps.insert(0, f"PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True in the environment: {loose} were reserved "
                        "by the caching allocator but unallocated, in pieces too small for this allocation "
                        "(micro-batches of changing shapes, such as images of different sizes, fragment it).")
    lines += [f"  - {s}" for s in steps]
    lines.append("`fastdpo tune` measures which checkpointing policy and token budget fit fastest; `fastdpo verify` "
                 "shows what each policy saves.")
    return FastDPOError("\n".join(lines))
