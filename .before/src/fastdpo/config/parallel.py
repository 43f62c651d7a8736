"""What --fsdp / --deepspeed ask for: the parallel plan (DDP, FSDP2 full_shard / shard_grad_op), read from the
flags or from a DeepSpeed JSON, with what cannot be honoured refused before anything starts."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from fastdpo.errors import FastDPOError

LESS_MEMORY = ("Lower memory with --train_type lora/qlora, --deepspeed zero3 (FSDP2 sharding), --gradient_checkpointing "
               "full, --precompute_ref_log_probs or --activation_offloading.")

FSDP_MODES = ("full_shard", "shard_grad_op", "no_shard")
FSDP_OPTIONS = ("auto_wrap",)  # accepted for HF compatibility: units of --fsdp_layers_per_unit decoder layers
DEEPSPEED_ALIASES = {"zero2": "shard_grad_op", "zero3": "full_shard"}



# ---------------------------------------------------------------- what --fsdp / --deepspeed ask for


@dataclass
class Plan:
    """How ranks share the model: `ddp` (replicas) or `fsdp` (FSDP2 shards), and what the flags mapped to."""

    mode: str = "ddp"
    reshard_after_forward: bool = True
    notes: list[str] = field(default_factory=list)


def parallel_plan(fsdp: str, deepspeed: str, cfg=None) -> Plan:
    """Map `--fsdp` / `--deepspeed` onto DDP or FSDP2. Raises FastDPOError for what cannot be honoured.

    full_shard = zero3: FSDP2 resharding after forward (parameters gathered again in backward).
    shard_grad_op = zero2: FSDP2 keeping gathered parameters from forward to backward.
    no_shard (or nothing): DDP.
    """
    plan = _requested_plan(fsdp, deepspeed, cfg)
    if plan.mode == "fsdp" and cfg is not None and cfg.train_type == "qlora":
        raise FastDPOError("--train_type qlora cannot be sharded with FSDP2 (4-bit base weights). Drop --fsdp/--deepspeed "
                           "to use DDP: QLoRA trains only the adapters, which DDP replicates cheaply.")
    return plan


def _requested_plan(fsdp: str, deepspeed: str, cfg) -> Plan:
    if fsdp and deepspeed:
        raise FastDPOError("--fsdp and --deepspeed both set: choose one (--deepspeed zero3 = --fsdp full_shard).")
    if deepspeed:
        if deepspeed in DEEPSPEED_ALIASES:
            mode = DEEPSPEED_ALIASES[deepspeed]
            plan = _plan_for(mode)
            plan.notes.append(f"--deepspeed {deepspeed} -> --fsdp {mode} ({_describe(mode)})")
            return plan
        if deepspeed.endswith("_offload") and deepspeed[: -len("_offload")] in DEEPSPEED_ALIASES:
            raise FastDPOError(f"--deepspeed {deepspeed}: CPU offload is not supported. Use --deepspeed "
                               f"{deepspeed[: -len('_offload')]} (FSDP2 sharding) and, if memory is short, "
                               "--gradient_checkpointing or more ranks.")
        if deepspeed.endswith(".json") or Path(deepspeed).is_file():
            return deepspeed_json_plan(deepspeed, cfg)
        raise FastDPOError(f"--deepspeed {deepspeed!r}: use zero2, zero3, or the path of a DeepSpeed JSON file.")
    if not fsdp:
        return Plan("ddp", notes=["DDP (parameters replicated on every rank)"])
    words = fsdp.replace(",", " ").split()
    modes = [w for w in words if w in FSDP_MODES]
    unknown = [w for w in words if w not in FSDP_MODES + FSDP_OPTIONS]
    if "offload" in unknown:
        raise FastDPOError(f"--fsdp {fsdp!r}: CPU offload is not supported. Drop `offload`; use "
                           "--gradient_checkpointing or more ranks if memory is short.")
    if unknown or len(modes) != 1:
        raise FastDPOError(f"--fsdp {fsdp!r}: give one of {', '.join(FSDP_MODES)} (optionally with auto_wrap).")
    plan = _plan_for(modes[0])
    plan.notes.append(f"--fsdp {modes[0]} -> {_describe(modes[0])}")
    return plan


def _plan_for(mode: str) -> Plan:
    if mode == "no_shard":
        return Plan("ddp")
    return Plan("fsdp", reshard_after_forward=mode == "full_shard")


def _describe(mode: str) -> str:
    return {"full_shard": "FSDP2, parameters resharded after forward (ZeRO-3)",
            "shard_grad_op": "FSDP2, parameters kept gathered from forward to backward (ZeRO-2)",
            "no_shard": "DDP, parameters replicated"}[mode]


def deepspeed_json_plan(path: str, cfg=None) -> Plan:
    """Read a DeepSpeed config: map the ZeRO stage, check batch/clipping values against our flags, and say what
    does not carry over (DeepSpeed's engine knobs have no FSDP2 counterpart)."""
    p = Path(path)
    if not p.is_file():
        raise FastDPOError(f"--deepspeed {path}: file not found. Give zero2, zero3 or an existing JSON file.")
    try:
        ds = json.loads(p.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise FastDPOError(f"--deepspeed {path} line {e.lineno}: not valid JSON ({e.msg}).") from None
    if not isinstance(ds, dict):
        raise FastDPOError(f"--deepspeed {path}: expected a JSON object at the top level.")
    zero = ds.get("zero_optimization", {}) or {}
    stage = int(zero.get("stage", 0))
    mode = {0: "no_shard", 1: "shard_grad_op", 2: "shard_grad_op", 3: "full_shard"}.get(stage)
    if mode is None:
        raise FastDPOError(f"--deepspeed {path}: zero_optimization.stage {stage} is not 0-3.")
    plan = _plan_for(mode)
    mapped = [f"zero_optimization.stage={stage} -> --fsdp {mode} ({_describe(mode)})"]
    ignored = []
    for key in ("offload_optimizer", "offload_param"):
        device = (zero.get(key) or {}).get("device", "none")
        if device not in ("none", None):  # as the --offload_* flags and --deepspeed zero3_offload: refused
            raise FastDPOError(f"--deepspeed {path}: zero_optimization.{key}.device={device}: DeepSpeed's CPU/NVMe "
                               f"offload is not available in fastdpo. Remove it (or set \"device\": \"none\"). "
                               f"{LESS_MEMORY}")
    checks = {"train_micro_batch_size_per_gpu": "per_device_train_batch_size",
              "gradient_accumulation_steps": "gradient_accumulation_steps", "gradient_clipping": "max_grad_norm"}
    for key, flag in checks.items():
        if key not in ds or ds[key] == "auto" or cfg is None:
            continue
        ours = getattr(cfg, flag)
        if float(ds[key]) != float(ours):
            raise FastDPOError(f"--deepspeed {path}: {key}={ds[key]} but --{flag} is {ours}. Set --{flag} "
                               f"{ds[key]} or write \"auto\" in the JSON.")
        mapped.append(f"{key}={ds[key]} (matches --{flag})")
    if (ds.get("bf16") or {}).get("enabled") is True:
        mapped.append("bf16.enabled -> bf16 parameters with fp32 gradient reductions (--torch_dtype auto|bfloat16)")
    if (ds.get("fp16") or {}).get("enabled") is True:
        ignored.append("fp16 (loss-scaled fp16 is not supported; use --torch_dtype bfloat16)")
    for key in ("optimizer", "scheduler"):
        if key in ds:
            ignored.append(f"{key} (fastdpo uses AdamW and --lr_scheduler_type; set --learning_rate etc.)")
    known = set(checks) | {"zero_optimization", "bf16", "fp16", "optimizer", "scheduler", "train_batch_size"}
    ignored += [f"{k} (DeepSpeed engine setting)" for k in ds if k not in known]
    ignored += [f"zero_optimization.{k} (DeepSpeed engine setting)" for k in zero
                if k not in ("stage", "offload_optimizer", "offload_param")]
    plan.notes.append(f"--deepspeed {path}: mapped " + "; ".join(mapped))
    if ignored:
        plan.notes.append(f"--deepspeed {path}: not mapped " + "; ".join(ignored))
    return plan
