"""`NPROC_PER_NODE=8 fastdpo train ...`, as ms-swift users write it: run the same command under torch's elastic
launcher (what `torchrun` runs), one worker per GPU, and turn a failed rank into one message that names it.

Env vars (ms-swift names): NPROC_PER_NODE, NNODES (1), NODE_RANK (0), MASTER_ADDR, MASTER_PORT. One node without
MASTER_PORT picks a free port (torchrun --standalone)."""

from __future__ import annotations

import logging
import os
import signal

from fastdpo.config.launch import LAUNCHED, check_world, env_int, world_size
from fastdpo.errors import FastDPOError

log = logging.getLogger("fastdpo")


def torchrun_args(argv: list[str], env: dict, visible_gpus: int) -> list[str]:
    """The torchrun command line (without `torchrun`) that runs `fastdpo <argv>` as the env vars describe."""
    nproc = env_int(env, "NPROC_PER_NODE", low=1)
    nnodes = env_int(env, "NNODES", 1, low=1)
    node_rank = env_int(env, "NODE_RANK", 0)
    if visible_gpus and nproc > visible_gpus:
        raise FastDPOError(
            f"NPROC_PER_NODE={nproc} but only {visible_gpus} GPUs are visible "
            f"(CUDA_VISIBLE_DEVICES={env.get('CUDA_VISIBLE_DEVICES', 'unset')}). Set NPROC_PER_NODE={visible_gpus} "
            "or make more GPUs visible."
        )
    if node_rank >= nnodes:
        raise FastDPOError(f"NODE_RANK={node_rank} must be below NNODES={nnodes}.")
    args = ["--nproc_per_node", str(nproc), "--max_restarts", "0"]
    if nnodes == 1 and not env.get("MASTER_PORT"):
        args.append("--standalone")
    else:
        if nnodes > 1 and not env.get("MASTER_ADDR"):
            raise FastDPOError(f"NNODES={nnodes}: set MASTER_ADDR (the address of the node with NODE_RANK=0) and "
                               "MASTER_PORT on every node.")
        args += ["--nnodes", str(nnodes), "--node_rank", str(node_rank),
                 "--master_addr", env.get("MASTER_ADDR", "127.0.0.1"), "--master_port", env.get("MASTER_PORT", "29500")]
    return args + ["-m", "fastdpo", *argv]


def failure_message(failures: dict) -> str:
    """One message from torchrun's failures {global rank: ProcessFailure}: first the likely cause (a rank killed
    outright, else the earliest error exit), then the others; ranks the launcher stopped with SIGTERM come last."""

    def stopped(f) -> bool:  # ended by the launcher (SIGTERM), directly or after a graceful stop (128 + 15)
        return f.exitcode in (-signal.SIGTERM, 128 + signal.SIGTERM)

    def by_signal(f) -> bool:  # killed outright (SIGKILL, SIGSEGV, ...): a cause, not a consequence
        return f.exitcode < 0 and not stopped(f)

    def how(f) -> str:
        return f"was killed by {f.signal_name()}" if f.exitcode < 0 else f"exited with code {f.exitcode}"

    order = sorted(failures, key=lambda r: (not by_signal(failures[r]), stopped(failures[r]), failures[r].timestamp, r))
    first = failures[order[0]]
    msg = f"rank {order[0]} (local rank {first.local_rank}, pid {first.pid}) {how(first)}"
    if order[1:]:
        msg += "; then " + ", ".join(f"rank {r} {how(failures[r])}" for r in order[1:])
    return f"training failed: {msg}. The whole job was stopped; each rank's own error, if any, is printed above."


def launch(argv: list[str], cfg=None, typed: dict[str, str] | None = None) -> int:
    """Run `fastdpo <argv>` on NPROC_PER_NODE workers of this node; returns 0 or raises FastDPOError. `cfg` (the
    config the command line builds) is validated here, with the world size the workers will have, before any of them
    starts: a bad flag fails once, naming the flag as typed (`typed`: field -> flag), not once per rank."""
    import torch
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    args = torchrun_args(argv, dict(os.environ), gpus)
    if cfg is not None:
        cfg.validate_training()
        nodes = f" x NNODES={os.environ['NNODES']}" if os.environ.get("NNODES", "1") != "1" else ""
        check_world(cfg, world_size(), typed, f"NPROC_PER_NODE={os.environ['NPROC_PER_NODE']}{nodes}")
    if not gpus:
        log.info("No GPU visible: %s CPU worker processes (gloo).", os.environ["NPROC_PER_NODE"])
    before = os.environ.get(LAUNCHED)
    os.environ[LAUNCHED] = "1"  # the workers inherit it: the notes about the flags were printed here
    try:
        run(parse_args(args))
    except ChildFailedError as e:
        raise FastDPOError(failure_message(e.failures)) from None
    except SignalException as e:  # preemption: the workers got the signal too, finished their step and saved
        log.warning("%s: workers stopped after a checkpoint. Continue with --resume_from_checkpoint latest.",
                    e.sigval.name)
        return 128 + int(e.sigval)
    finally:  # for the workers only: this process (a Python caller's) prints its later notes
        if before is None:
            os.environ.pop(LAUNCHED, None)
        else:
            os.environ[LAUNCHED] = before
    return 0
