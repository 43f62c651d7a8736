"""Run `train` on several CPU ranks (gloo) from a test: forked from a forkserver that imported the trainer once, so
each multi-rank run costs seconds, not a fresh interpreter per rank."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import socket
import time
import traceback
from pathlib import Path

import torch
from data_helpers import easy_rows, write_jsonl
from safetensors.torch import load_file

ROWS = 41  # 5 full steps of 8 pairs, then a 1-pair step: one rank gets nothing and must still join the collectives
BASE = dict(learning_rate=1e-3, max_steps=6, seed=3, adam_epsilon=1e-6, disable_progress=True)


def dataset(tmp_path):
    return write_jsonl(tmp_path / "data.jsonl", easy_rows(ROWS, seed=1))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, kwargs: dict) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    from fastdpo.config import TrainConfig
    from fastdpo.training.loop import train

    try:
        result = train(TrainConfig(**kwargs), progress=False)
    except BaseException:
        traceback.print_exc()
        os._exit(1)
    os._exit(result.get("exit_code", 0))


def _context():
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "transformers", "fastdpo.training.loop", "dist_helpers"])
    return ctx


def start_ranks(world: int, **kwargs) -> list:
    """Start `world` ranks training with `kwargs`; returns their processes."""
    ctx = _context()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, kwargs)) for r in range(world)]
    for p in procs:
        p.start()
    return procs


def join_ranks(procs: list, timeout: float = 120) -> list[int]:
    """Wait for the ranks (killing them after `timeout`, which fails the test); returns their exit codes."""
    deadline = time.monotonic() + timeout
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    alive = [p for p in procs if p.is_alive()]
    for p in alive:
        p.kill()
    assert not alive, f"ranks still running after {timeout}s"
    return [p.exitcode for p in procs]


def _isolated(fn, args: tuple) -> None:
    try:
        fn(*args)
    except BaseException:
        traceback.print_exc()
        os._exit(1)
    os._exit(0)


def run_isolated(fn, *args, timeout: float = 120) -> None:
    """Run `fn(*args)` (a module-level function) in a child process; fail the test if it raises. For DDP on a
    one-rank gloo group inside the test process: the child ends with os._exit, so the group is never torn down
    while Python holds the GIL. Torn down in the test process, its worker thread may still be releasing a DDP comm
    hook's Python callback, which needs the GIL, while the main thread holds it and joins that thread: a hang."""
    proc = _context().Process(target=_isolated, args=(fn, args))
    proc.start()
    assert join_ranks([proc], timeout) == [0], "the isolated test body failed (its traceback is in the captured output)"


def _rank_body(rank: int, world: int, port: int, fn, args: tuple) -> None:
    import torch.distributed as dist

    try:
        store = dist.TCPStore("127.0.0.1", port, world, is_master=rank == 0)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
        fn(rank, world, *args)
    except BaseException:
        traceback.print_exc()
        os._exit(1)
    os._exit(0)


def run_on_ranks(world: int, fn, *args, timeout: float = 120) -> None:
    """Run `fn(rank, world, *args)` (a module-level function) on `world` gloo ranks; fail the test if any raises."""
    ctx, port = _context(), _free_port()
    procs = [ctx.Process(target=_rank_body, args=(r, world, port, fn, args)) for r in range(world)]
    for p in procs:
        p.start()
    assert join_ranks(procs, timeout) == [0] * world, "a rank failed (its traceback is in the captured output)"


def run_ranks(world: int, timeout: float = 120, **kwargs) -> None:
    """Train with `kwargs` on `world` ranks; fail the test if any rank fails or the job outlives `timeout`."""
    codes = join_ranks(start_ranks(world, **kwargs), timeout)
    assert codes == [0] * world, codes

def weights(out: Path) -> dict:
    return load_file(str(out / "final" / "model.safetensors"))


def metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in open(out / "metrics.jsonl")]


def assert_weights_close(a: dict, b: dict, atol: float) -> None:
    assert sorted(a) == sorted(b)
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=atol, msg=k)
