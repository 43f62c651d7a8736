"""Python's garbage collection during training: pauses measured per step, setup frozen; with --gc_steps, no
automatic collection and a collection every N steps; Python's settings back afterwards."""

import gc
import weakref

import pytest

from fastdpo.observe.gcpause import GcPauses


class Node:
    pass


def _cycle():
    """A reference cycle only the cyclic collector frees; returns a weak reference to watch it."""
    a, b = Node(), Node()
    a.other, b.other = b, a
    return weakref.ref(a)


def test_setup_is_frozen_and_python_keeps_its_schedule():
    """By default what exists when training starts is frozen (no collection walks it again) while Python still
    collects on its own schedule: a cycle made during training goes without any explicit collection. Pauses are
    counted; the freeze's own collection is setup's, not a step's; afterwards nothing stays frozen."""
    setup = [Node() for _ in range(100)]

    def walked():  # whether a collection would walk the setup objects
        return any(o is setup for o in gc.get_objects())

    assert walked()
    pauses = GcPauses().start()
    try:
        assert gc.isenabled() and gc.get_freeze_count() > 0 and not walked()
        assert pauses.take()["gc/collections"] == 0
        garbage = _cycle()
        alive = [Node() for _ in range(50_000)]  # far past the thresholds that trigger an automatic collection
        assert garbage() is None and alive  # collected by Python's own schedule
        assert pauses.take()["gc/collections"] >= 1
        gc.collect()
        gc.collect(0)
        got = pauses.take()
        assert got["gc/collections"] == 2 and got["gc/pause_ms"] > 0
        assert pauses.take()["gc/collections"] == 0  # taken: counted once
    finally:
        pauses.stop()
    assert gc.isenabled() and gc.get_freeze_count() == 0 and walked()
    gc.collect()
    assert pauses.take()["gc/collections"] == 0  # stopped: no longer watching


def test_scheduled_collection_every_n_steps_then_python_settings_back():
    assert gc.isenabled()
    pauses = GcPauses(every=3).start()
    try:
        assert not gc.isenabled() and gc.get_freeze_count() > 0  # setup frozen, automatic collection off
        assert pauses.take()["gc/collections"] == 0  # the freeze's own collection is not a step's
        garbage = _cycle()
        for _ in range(50_000):  # far past the thresholds that would trigger an automatic collection
            Node()
        pauses.step_end(1)
        pauses.step_end(2)
        assert garbage() is not None  # not collected between scheduled steps
        pauses.step_end(3)
        assert garbage() is None
        assert pauses.take()["gc/collections"] == 1
    finally:
        pauses.stop()
    assert gc.isenabled() and gc.get_freeze_count() == 0


def test_a_collector_disabled_before_stays_disabled():
    gc.disable()
    try:
        pauses = GcPauses(every=1).start()
        pauses.stop()
        assert not gc.isenabled() and gc.get_freeze_count() == 0
    finally:
        gc.enable()


def test_a_freeze_made_before_training_stays():
    gc.freeze()
    try:
        GcPauses().start().stop()
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()


def test_negative_gc_steps_is_a_clear_error():
    from fastdpo.config import TrainConfig
    from fastdpo.errors import FastDPOError

    with pytest.raises(FastDPOError, match="--gc_steps must be >= 0"):
        TrainConfig(model="m", dataset=["d"], gc_steps=-1).validate()
