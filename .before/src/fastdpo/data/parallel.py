"""Ordered parallel map over chunks with worker processes and a bounded look-ahead window.

Results come back in input order whatever the number of workers, so tokenised data never depends on parallelism.
The input is consumed lazily (at most `window` chunks in flight), so a streamed file is never read ahead of need.
Workers are forked where the platform allows (start-up in milliseconds; they inherit `state` without pickling and
touch neither torch nor CUDA), else spawned with `state` pickled once.
"""

from __future__ import annotations

import multiprocessing
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ProcessPoolExecutor

_STATE = None


def _init(state) -> None:
    global _STATE
    _STATE = state


def _call(fn: Callable, item):
    return fn(_STATE, item)


def ordered_map(fn: Callable, items: Iterable, state, workers: int = 0, window: int = 0) -> Iterator:
    """Yield `fn(state, item)` for each item, in order. `workers` <= 0 runs in this process. `fn` must be a
    module-level function (picklable)."""
    if workers <= 0:
        for item in items:
            yield fn(state, item)
        return
    window = window or 2 * workers
    method = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
    pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context(method), initializer=_init,
                               initargs=(state,))
    pending: deque = deque()
    try:
        for item in items:
            pending.append(pool.submit(_call, fn, item))
            if len(pending) >= window:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
