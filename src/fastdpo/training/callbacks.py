"""Callbacks of `train(cfg, callbacks=[...])`: plain functions (called as `on_step`) or objects with any of the hooks
below. Every rank calls them (a hook that writes files or prints should check the rank itself).

A hook that returns `"stop"` stops the run as a signal would: after this step a checkpoint is saved and `train`
returns with `stopped="callback"` (resume it with `resume_from_checkpoint="latest"`). Any rank asking stops all.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from fastdpo.errors import FastDPOError

STOP = "stop"
HOOKS = ("on_train_begin", "on_step", "on_evaluate", "on_save", "on_train_end")


class Callbacks:
    """The run's callbacks, called in the order given; `should_stop` once a hook returned "stop"."""

    def __init__(self, callbacks: Iterable | None = None):
        self.callbacks = list(callbacks or [])
        self.should_stop = False
        for cb in self.callbacks:
            assert_usable(cb)

    def _call(self, hook: str, *args) -> None:
        for cb in self.callbacks:
            fn = getattr(cb, hook, None) if _has_hooks(cb) else cb if hook == "on_step" else None
            if fn is not None and fn(*args) == STOP:
                self.should_stop = True

    def train_begin(self, trainer) -> None:
        """`on_train_begin(trainer)`: the Trainer, set up (and resumed: `trainer.global_step`), before the first step."""
        self._call("on_train_begin", trainer)

    def step(self, step: int, metrics: dict) -> None:
        """`on_step(step, metrics)`: each logged step (every --logging_steps and the last), with its metrics record."""
        self._call("on_step", step, metrics)

    def evaluate(self, step: int, metrics: dict) -> None:
        """`on_evaluate(step, metrics)`: after each evaluation of the held-out pairs."""
        self._call("on_evaluate", step, metrics)

    def save(self, step: int, path: Path) -> None:
        """`on_save(step, path)`: after each checkpoint and the final model are written."""
        self._call("on_save", step, path)

    def train_end(self, result) -> None:
        """`on_train_end(result)`: the TrainResult, before `train` returns it."""
        self._call("on_train_end", result)


def _has_hooks(cb: object) -> bool:
    return any(callable(getattr(cb, hook, None)) for hook in HOOKS)


def assert_usable(cb: object) -> None:
    if not (_has_hooks(cb) or callable(cb)):
        raise FastDPOError(f"callbacks: {cb!r} is neither callable nor has any of {', '.join(HOOKS)}. Pass a function "
                           "(called as on_step(step, metrics)) or an object with some of those methods.")
