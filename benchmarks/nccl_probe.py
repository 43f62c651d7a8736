"""Collective bandwidth between the GPUs of one host, as FSDP2 and DDP use them: all-gather and reduce-scatter of a
bf16 / fp32 buffer the size of a Qwen3-1.7B shard, timed after warm-up. Run with torchrun:

    torchrun --nproc_per_node 2 benchmarks/nccl_probe.py [--gib 1.6]

Prints per collective: ms and the bus bandwidth in GB/s (NCCL's convention: bytes × (n-1)/n / time)."""

import argparse
import os
import time

import torch
import torch.distributed as dist


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn, reps: int = 10) -> float:
    for _ in range(3):
        fn()
    sync()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    sync()
    return (time.perf_counter() - t0) / reps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gib", type=float, default=1.6, help="size of the gathered (full) buffer in GiB")
    a = p.parse_args()
    cuda = torch.cuda.is_available()  # without GPUs: gloo on CPU, to check the script itself
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    device = "cuda" if cuda else "cpu"
    for dtype in (torch.bfloat16, torch.float32):
        numel = int(a.gib * 2**30 / dtype.itemsize) // world * world
        full = torch.empty(numel, dtype=dtype, device=device)
        shard = torch.empty(numel // world, dtype=dtype, device=device)
        nbytes = numel * dtype.itemsize
        calls = (("all_gather", lambda f=full, s=shard: dist.all_gather_into_tensor(f, s)),
                 ("reduce_scatter", lambda f=full, s=shard: dist.reduce_scatter_tensor(s, f)),
                 ("all_reduce", lambda f=full: dist.all_reduce(f)))
        for name, fn in calls:
            if not cuda and name == "reduce_scatter":
                continue  # gloo has no reduce_scatter_tensor
            t = timed(fn)
            factor = 2 * (world - 1) / world if name == "all_reduce" else (world - 1) / world
            if rank == 0:
                print(f"{name:15s} {str(dtype).removeprefix('torch.'):9s} {nbytes / 2**30:5.2f} GiB  {t * 1e3:8.2f} ms  "
                      f"bus {nbytes * factor / t / 1e9:7.1f} GB/s", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
