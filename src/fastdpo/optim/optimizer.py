"""Optimizer and learning-rate schedule."""

from __future__ import annotations

import math

import torch

from fastdpo.config import OptimizerSection
from fastdpo.errors import FastDPOError


def build_optimizer(model: torch.nn.Module, cfg: OptimizerSection, device: torch.device,
                    seed: int = 0) -> torch.optim.Optimizer:
    """AdamW; weight decay on matrices only (not on norms, biases or other vectors). With bfloat16 trainable weights
    and --update_rounding stochastic (the default), fastdpo's AdamW (`fastdpo.optim.adamw`, its rounding drawn from
    `seed`), else torch's (fused on CUDA)."""
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.ndim >= 2 else no_decay).append(p)
    if not decay and not no_decay:
        raise FastDPOError("The model has no trainable parameters. Check --train_type and --target_modules.")
    groups = [g for g in ({"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0})
              if g["params"]]
    hyper = dict(lr=cfg.learning_rate, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_epsilon)
    if cfg.update_rounding == "stochastic" and any(p.dtype == torch.bfloat16 for p in decay + no_decay):
        from fastdpo.optim.adamw import AdamW

        return AdamW(groups, seed=seed, **hyper)
    return torch.optim.AdamW(groups, fused=device.type == "cuda", **hyper)


def scales_gradients(optimizer: torch.optim.Optimizer) -> bool:
    """Whether `step_unless_nonfinite` can hand this optimizer clipping's coefficient, to scale the gradients as its
    update reads them (fastdpo's AdamW) instead of a pass that scales them in place first."""
    from fastdpo.optim.adamw import AdamW

    return isinstance(optimizer, AdamW)


def step_unless_nonfinite(optimizer: torch.optim.Optimizer, finite: torch.Tensor,
                          grad_scale: torch.Tensor | None = None) -> bool:
    """`optimizer.step()` whose update is skipped where `finite` (a one-element bool tensor, e.g. on the GPU) is
    false. fastdpo's AdamW and torch's fused AdamW obey the flag on the device, so the host queues the update
    without waiting for the backward to finish; other optimizers read the flag first. `grad_scale` (only where
    `scales_gradients`): the update's gradients are these times it. Returns whether step() was called (a skipped
    call leaves the weights and moments as they were; `undo_step_count` then fixes the counts)."""
    from fastdpo.optim.adamw import AdamW

    if isinstance(optimizer, AdamW):
        optimizer.step(finite=finite, grad_scale=grad_scale)
        return True
    if grad_scale is not None:
        raise ValueError(f"{type(optimizer).__name__} cannot scale the gradients it reads: clip them in place.")
    if isinstance(optimizer, torch.optim.Adam) and optimizer.defaults.get("fused"):
        optimizer.found_inf = (~finite).reshape(()).float()  # read by the fused kernel, as under a GradScaler
        try:
            optimizer.step()
        finally:
            del optimizer.found_inf
        return True
    if bool(finite):
        optimizer.step()
        return True
    return False


def undo_step_count(optimizer: torch.optim.Optimizer) -> None:
    """After a step() that `step_unless_nonfinite` skipped: take back the step counts kept on the host (torch's
    fused AdamW takes its own back on the device)."""
    from fastdpo.optim.adamw import AdamW

    if isinstance(optimizer, AdamW):
        optimizer.rewind()


def lr_lambda(cfg: OptimizerSection, total_steps: int):
    """Multiplier of the peak learning rate at each step, HF-compatible schedules."""
    warmup = cfg.warmup_steps if cfg.warmup_steps > 0 else math.ceil(cfg.warmup_ratio * total_steps)
    kind = cfg.lr_scheduler_type
    kwargs = dict(cfg.lr_scheduler_kwargs)
    min_ratio = 0.0
    if kind == "cosine_with_min_lr":
        if "min_lr" in kwargs:
            min_ratio = float(kwargs["min_lr"]) / cfg.learning_rate if cfg.learning_rate else 0.0
        elif "min_lr_rate" in kwargs:
            min_ratio = float(kwargs["min_lr_rate"])
        else:
            raise FastDPOError("--lr_scheduler_type cosine_with_min_lr needs --lr_scheduler_kwargs '{\"min_lr\": 1e-7}'.")
    num_cycles = float(kwargs.get("num_cycles", 0.5))

    def f(step: int) -> float:
        if kind == "constant":
            return 1.0
        if step < warmup:
            return step / max(1, warmup)
        if kind == "constant_with_warmup":
            return 1.0
        progress = (step - warmup) / max(1, total_steps - warmup)
        if kind == "linear":
            return max(0.0, 1.0 - progress)
        cos = 0.5 * (1.0 + math.cos(math.pi * 2.0 * num_cycles * progress))
        return max(0.0, cos) if kind == "cosine" else min_ratio + (1 - min_ratio) * max(0.0, cos)

    return f


def build_scheduler(opt: torch.optim.Optimizer, cfg: OptimizerSection, total_steps: int):
    return torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(cfg, total_steps))


# the flags lr_lambda and build_scheduler read, with total_steps (set by max_steps, else num_train_epochs)
SCHEDULE_FLAGS = ("learning_rate", "lr_scheduler_type", "lr_scheduler_kwargs", "warmup_steps", "warmup_ratio",
                  "max_steps", "num_train_epochs")


def _overridden(name: str, flags: dict) -> bool:
    return ((name == "num_train_epochs" and flags.get("max_steps", 0) > 0)
            or (name == "warmup_ratio" and flags.get("warmup_steps", 0) > 0))


def schedule_changes(saved: dict, cfg: OptimizerSection) -> list[tuple[str, object, object]]:
    """(flag, old, new) for each flag that shapes the learning-rate schedule and differs between a checkpoint's saved
    config and `cfg`; a flag another one overrides in both (num_train_epochs under max_steps, warmup_ratio under
    warmup_steps) does not count."""
    now = {name: getattr(cfg, name) for name in SCHEDULE_FLAGS}
    return [(name, saved[name], now[name]) for name in SCHEDULE_FLAGS
            if name in saved and saved[name] != now[name]
            and not (_overridden(name, saved) and _overridden(name, now))]


def follow_schedule(scheduler: torch.optim.lr_scheduler.LambdaLR, cfg: OptimizerSection, total_steps: int) -> None:
    """Put a restored scheduler on the schedule `cfg` defines, at the step it has reached: as if it had been built
    from `cfg`. The optimizer's moments and step counts stay as they are."""
    fn = lr_lambda(cfg, total_steps)
    groups = scheduler.optimizer.param_groups
    scheduler.lr_lambdas = [fn] * len(groups)
    scheduler.base_lrs = [cfg.learning_rate] * len(groups)
    for g in groups:
        g["initial_lr"] = cfg.learning_rate
        g["lr"] = cfg.learning_rate * fn(scheduler.last_epoch)
    scheduler._last_lr = [g["lr"] for g in groups]
