"""The run monitor the training loop talks to: a guard around each optimizer update (NaN/Inf loss or gradient: skip
the update, count it, stop after N in a row), the vital signs added to each logged record (`update_gap`,
`skipped_steps`), the alert engine, and the sinks."""

from __future__ import annotations

import contextlib
import logging
import math
import sys
from pathlib import Path

import torch

from fastdpo import checkpoint as ckpt
from fastdpo.errors import FastDPOError
from fastdpo.observe.alerts import ADVICE, AlertEngine, AlertRules
from fastdpo.observe.sinks import Sinks, open_sinks

log = logging.getLogger("fastdpo")


class NonFiniteStop(FastDPOError):
    """Raised when too many optimizer steps in a row had a non-finite loss or gradient."""


def finite_flag(loss_sum: torch.Tensor, grad_norm: torch.Tensor) -> torch.Tensor:
    """True where the step's loss and gradient norm are both finite: a bool tensor on the loss's device, computed
    without a host sync (the update can obey it on the device, `optim.step_unless_nonfinite`)."""
    norm = torch.as_tensor(grad_norm, device=loss_sum.device)
    return torch.isfinite(torch.stack([loss_sum.double(), norm.double()])).all()


class Monitor:
    """One per run. Call `finite_update` once per optimizer step (with the step's `finite_flag`), `log` once per logged
    step, and `close` at the end. Distributed: every rank keeps a monitor (the guard must decide alike everywhere:
    pass the step's loss summed over ranks and the gradient norm of the reduced gradients); only the rank with
    `write=True` writes sinks and raises alerts."""

    def __init__(self, cfg, out_dir: Path, console, optimizer: torch.optim.Optimizer, start_step: int,
                 write: bool = True, world_size: int = 1):
        self.out_dir = out_dir
        # a step's rows are all ranks' pairs; each rank runs its micro-steps in parallel with the others
        self.micro_pairs = cfg.per_device_train_batch_size * world_size
        self.max_in_a_row = cfg.max_nonfinite_steps
        self.engine = AlertEngine(AlertRules(patience=cfg.alert_patience, kl_ratio_threshold=cfg.kl_ratio_threshold))
        self.writer = write
        self.sinks = open_sinks(cfg, out_dir, console, start_step) if write else Sinks([])
        self.skipped = 0
        self.in_a_row = 0
        self.failed = False  # a sink's write failed
        self.last_good_step = self.start_step = start_step
        self._reset_window()
        # count real optimizer.step() calls, so a wrapper that skips or repeats them shows up in update_gap
        self._hook = optimizer.register_step_post_hook(self._count_update)

    def _reset_window(self) -> None:
        self.w_pairs = self.w_steps = self.w_skipped = self.w_updates = 0

    def _count_update(self, *_) -> None:
        self.w_updates += 1

    def finite_update(self, finite: bool, step: int, rows: list[int], stepped: bool = False) -> bool:
        """Count step `step`'s guard (`finite_flag`, read on the host after the update was queued). A non-finite
        step's update is skipped: by the caller, or, when `stepped`, by the optimizer on the device (that step()
        call is then not counted as an update); after `max_nonfinite_steps` such steps in a row the run stops with
        NonFiniteStop. Returns `finite`."""
        self.w_steps += 1
        self.w_pairs += len(rows)
        if finite:
            self.in_a_row = 0
            self.last_good_step = step
            return True
        if stepped:
            self.w_updates -= 1
        self.skipped += 1
        self.w_skipped += 1
        self.in_a_row += 1
        log.warning("step %d: NaN/Inf loss or gradient; update skipped (%d in a row, %d in all).", step,
                    self.in_a_row, self.skipped)
        if self.max_in_a_row and self.in_a_row >= self.max_in_a_row:
            raise NonFiniteStop(self._stop_message(step, rows))
        return False

    def _stop_message(self, step: int, rows: list[int]) -> str:
        found = ckpt.complete_checkpoints(self.out_dir)
        kept = (f"The last good checkpoint is {found[-1]} (resume with --resume_from_checkpoint latest)."
                if found else "No checkpoint was saved before this (set --save_steps to keep one).")
        shown = ", ".join(str(i) for i in sorted(rows)[:16]) + (" ..." if len(rows) > 16 else "")
        # no step of this run was finite: the cause came in with it (the weights were checked finite at the start)
        advice = ADVICE["nonfinite"] if self.last_good_step > self.start_step else (
            "no step of this run had a finite loss, so the learning rate is not the cause: check the reference "
            "(--ref_model, or its precomputed log-probs: --precompute_ref_log_probs rebuilds them when --ref_cache_dir "
            "is cleared) and the rows named.")
        return (f"Training stopped at step {step}: {self.in_a_row} steps in a row had a NaN/Inf loss or gradient "
                f"(--max_nonfinite_steps {self.max_in_a_row}). Their updates were skipped, so the weights are those "
                f"after step {self.last_good_step}. {kept} Dataset rows of the last bad step: {shown}. "
                f"Advice: {advice}")

    def log(self, record: dict) -> None:
        """Add the vital signs of the window since the last log, check the alerts, write every sink."""
        micro = self.w_pairs / self.micro_pairs
        record["update_gap"] = micro / self.w_updates if self.w_updates else math.inf
        record["skipped_steps"] = self.skipped
        expected_updates = self.w_steps - self.w_skipped
        expected = micro / expected_updates if expected_updates else None
        alerts = self.engine.check(record, expected) if self.writer else []
        with self._writing():
            self.sinks.log(record)
            for a in alerts:
                self.sinks.alert(a)
        self._reset_window()

    def write(self, record: dict) -> None:
        """Write a record that is not a training step (e.g. evaluation) to every sink, without alerts."""
        with self._writing():
            self.sinks.log(record)

    @contextlib.contextmanager
    def _writing(self):
        """A failed write of the metrics log (disk full) stops training with one message naming the last good
        checkpoint; closing the sinks then does not fail a second time on the same full disk."""
        try:
            yield
        except OSError as e:
            self.failed = True
            raise ckpt.write_failed("metrics.jsonl", self.out_dir, e) from None

    def close(self) -> None:
        self._hook.remove()
        try:
            self.sinks.close()
        except OSError as e:  # flushing what the sinks buffered
            if self.failed or sys.exc_info()[0] is not None:  # closed while another error stops the run: that one
                log.warning("Closing the metrics log failed too (%s).", e.strerror or e)
            else:
                raise ckpt.write_failed("metrics.jsonl", self.out_dir, e) from None
        raised = self.engine.summary()
        if raised:
            log.info("Alerts raised: %s (details in %s).", ", ".join(f"{k} x{v}" for k, v in raised.items()),
                     self.out_dir / "alerts.jsonl")
