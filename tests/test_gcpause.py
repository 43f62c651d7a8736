"""Python's garbage collection during training: pauses measured per step; with --gc_steps, frozen setup, no
automatic collection, a collection every N steps, and Python's settings back afterwards."""

import gc
import weakref

import pytest

from fastdpo.gcpause import GcPauses


class Node:
    pass


def _cycle():
    """A reference cycle only the cyclic collector frees; returns a weak reference to watch it."""
    a, b = Node(), Node()
    a.other, b.other = b, a
    return weakref.ref(a)


def test_pauses_are_measured_without_changing_python_schedule():
    pauses = GcPauses().start()
    try:
        assert gc.isenabled() and gc.get_freeze_count() == 0
        pauses.take()  # whatever Python collected since start
        gc.collect()
        gc.collect(0)
        got = pauses.take()
        assert got["gc/collections"] >= 2 and got["gc/pause_ms"] > 0
        assert pauses.take()["gc/collections"] == 0  # taken: counted once
    finally:
        pauses.stop()
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


def test_negative_gc_steps_is_a_clear_error():
    from fastdpo.config import TrainConfig
    from fastdpo.errors import FastDPOError

    with pytest.raises(FastDPOError, match="--gc_steps must be >= 0"):
        TrainConfig(model="m", dataset=["d"], gc_steps=-1).validate()
