"""The cross-rank heartbeat: names the rank that stopped progressing, tells a dead rank from a collective hang.
Unit tests drive a fake clock through an in-memory store; one test runs real processes through a FileStore."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

from fastdpo.parallel.heartbeat import Heartbeat


class DictStore:
    """The part of torch.distributed.Store the heartbeat uses."""

    def __init__(self):
        self.data = {}

    def set(self, key, value):
        self.data[key] = value.encode() if isinstance(value, str) else value

    def get(self, key):
        return self.data[key]

    def check(self, keys):
        return all(k in self.data for k in keys)


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def ranks(n, store, clock, reports, **kw):
    return [Heartbeat(store, r, n, interval=1.0, stall_after=30.0, dead_after=10.0, clock=clock,
                      report=lambda text, r=r: reports.append((r, text)), **kw) for r in range(n)]


def tick(hbs, clock, seconds, progress=(), alive=None):
    """Advance time second by second: ranks in `progress` beat each second; ranks in `alive` (default all) run
    their watchdog (publish + check)."""
    alive = range(len(hbs)) if alive is None else alive
    for _ in range(int(seconds)):
        clock.t += 1.0
        for r in progress:
            hbs[r].beat(hbs[r].step + 1, "forward")
        for r in alive:
            hbs[r].publish()
        for r in alive:
            text = hbs[r].check()
            if text:
                hbs[r].report(text)


def test_healthy_ranks_report_nothing():
    store, clock, reports = DictStore(), Clock(), []
    hbs = ranks(4, store, clock, reports)
    tick(hbs, clock, 120, progress=range(4))
    assert reports == []


def test_names_the_rank_that_stopped_while_others_wait():
    store, clock, reports = DictStore(), Clock(), []
    hbs = ranks(4, store, clock, reports)
    tick(hbs, clock, 5, progress=range(4))
    tick(hbs, clock, 2, progress=(0, 1, 3))  # rank 2 stops; the others run a little further, then wait for it
    tick(hbs, clock, 29)
    assert reports == []  # rank 2 quiet for 31 s, but the others for 29 s: they may still be waiting for it
    tick(hbs, clock, 60)
    assert len(reports) == 1  # once per stall, from one rank
    who, text = reports[0]
    assert who == 0
    assert "rank 2 (" in text and "stopped progressing while rank(s) 0,1,3 reached step 6" in text
    assert "last at step 4 'forward'" in text


def test_everyone_stalled_at_the_same_point_is_a_collective_hang():
    store, clock, reports = DictStore(), Clock(), []
    hbs = ranks(3, store, clock, reports)
    tick(hbs, clock, 5, progress=range(3))
    tick(hbs, clock, 40)
    assert len(reports) == 1 and "all 3 ranks stalled at step 4" in reports[0][1]
    assert "NCCL" in reports[0][1] and "fastdpo env" in reports[0][1]
    tick(hbs, clock, 3, progress=range(3))  # progress resumes: the next stall is reported again
    tick(hbs, clock, 40)
    assert len(reports) == 2


def test_dead_rank_is_named_by_the_lowest_live_rank():
    store, clock, reports = DictStore(), Clock(), []
    hbs = ranks(3, store, clock, reports)
    tick(hbs, clock, 5, progress=range(3))
    tick(hbs, clock, 40, alive=(1, 2))  # rank 0's process is gone: no heartbeat at all
    assert len(reports) == 1
    who, text = reports[0]
    assert who == 1 and "rank 0 (" in text and "died or froze" in text


def test_stuck_rank_logs_its_own_stack(caplog):
    store, clock, reports = DictStore(), Clock(), []
    hbs = ranks(2, store, clock, reports)
    tick(hbs, clock, 3, progress=range(2))
    with caplog.at_level("ERROR", logger="fastdpo"):
        tick(hbs, clock, 40, progress=(0,))
    stacks = [r.getMessage() for r in caplog.records if "main thread stack" in r.getMessage()]
    assert len(stacks) == 1 and "rank 1 made no progress" in stacks[0] and "test_stuck_rank_logs_its_own_stack" in stacks[0]


WORKER = textwrap.dedent("""
    import sys, time
    import torch.distributed as dist
    from fastdpo.parallel.heartbeat import Heartbeat

    rank, path, out = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    store = dist.FileStore(path, 3)
    store.add("ready", 1)
    while store.add("ready", 0) < 3:  # start together: process start-up times differ a lot
        time.sleep(0.05)

    def report(text):
        with open(out, "a") as f:
            f.write(f"{rank}: {text}\\n")

    def stuck_in_data_loading():
        time.sleep(5)

    with Heartbeat(store, rank, 3, interval=0.2, stall_after=2.0, report=report) as hb:
        for step in range(1, 30):
            hb.beat(step, "forward")
            if rank == 1 and step == 5:
                stuck_in_data_loading()
                break
            if step == 8:  # the others wait in the next collective
                time.sleep(5)
                break
            time.sleep(0.05)
""")


def test_real_processes_through_a_file_store(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    out = tmp_path / "reports.txt"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2] / "src")}
    procs = [subprocess.Popen([sys.executable, str(script), str(r), str(tmp_path / "store"), str(out)], env=env,
                              stderr=subprocess.PIPE, text=True) for r in range(3)]
    errs = [p.communicate(timeout=120)[1] for p in procs]
    assert all(p.returncode == 0 for p in procs), errs
    lines = out.read_text().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith("0: Heartbeat: rank 1 (") and "last at step 5 'forward'" in lines[0]
    assert "rank(s) 0,2 reached step 8" in lines[0]
    assert "stuck_in_data_loading" in errs[1]  # the stalled rank logged where it is stuck


def test_for_process_group_uses_the_rendezvous_store(tmp_path):
    import torch.distributed as dist

    assert Heartbeat.for_process_group(ddp_timeout=1800) is None  # not distributed
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        hb = Heartbeat.for_process_group(ddp_timeout=60)
        assert hb.stall_after == 20 and hb.interval == 20 / 3 and hb.world_size == 1
        with hb:
            hb.beat(7, "backward")
            hb.publish()
            assert hb.read()[0]["step"] == 7 and hb.read()[0]["phase"] == "backward"
    finally:
        dist.destroy_process_group()
