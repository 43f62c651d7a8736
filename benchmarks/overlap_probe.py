"""How much a gather running beside them slows a layer's kernels, by the way the gather moves its bytes.

    torchrun --nproc_per_node 2 benchmarks/overlap_probe.py [--shard_mib 336] [--tokens 8192] [--iters 12]

FSDP2's `full_shard` gathers the next unit's weights while the current unit computes. NCCL's gather kernels hold
SMs and memory bandwidth for as long as they run. On two H200s, an 8192-token forward computed 10-15 % longer under
`full_shard` than on one GPU (benchmarks/NOTES.md entry 43). This probe times three kernels of a Qwen3-1.7B layer
(the up projection's GEMM, the down projection's GEMM, SiLU-and-multiply) alone, and then while a chain of gathers
of one unit's shard (`--shard_mib`) runs on a side stream, for each of three kinds of gather:
  - `nccl`: NCCL's all-gather into `torch.empty` buffers, as FSDP2 does by default;
  - `nccl_registered`: the same, with buffers from the process group's allocator. FSDP2 uses those after
    `set_allocate_memory_from_process_group_for_comm(True)`, and NCCL may then take paths that use fewer SMs;
  - `copy_engine`: each rank copies the peer's shard out of symmetric memory with a device-to-device copy, which the
    copy engines carry and no SM runs.

Each way also gets its bandwidth alone. Only iterations that ended while the gathers still ran count as "beside".
Rank 0 prints one Markdown table. A way this torch or NCCL cannot do is listed with the reason.
"""

from __future__ import annotations

import argparse
import os
import statistics

import torch
import torch.distributed as dist


def kernels(tokens: int, hidden: int = 2048, ffn: int = 6144):
    """(name, fn) for three kernels of one decoder layer at `tokens` tokens, bfloat16."""
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
    up = torch.randn(hidden, ffn, device="cuda", dtype=torch.bfloat16)
    down = torch.randn(ffn, hidden, device="cuda", dtype=torch.bfloat16)
    a = torch.randn(tokens, ffn, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(tokens, ffn, device="cuda", dtype=torch.bfloat16)
    return [("up GEMM", lambda: x @ up), ("down GEMM", lambda: a @ down),
            ("silu*mul", lambda: torch.nn.functional.silu(a) * b)]


def time_each(fn, iters: int) -> list[tuple[torch.cuda.Event, torch.cuda.Event]]:
    """Queue `iters` runs of fn on the current stream, each between two timing events."""
    out = []
    for _ in range(iters):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        out.append((s, e))
    return out


def ways(group, numel: int, world: int, rank: int):
    """{name: (gather fn or None, reason)}: each way of gathering one shard of `numel` bfloat16 elements."""
    found = {}
    out = torch.empty(numel * world, device="cuda", dtype=torch.bfloat16)
    inp = out[rank * numel:(rank + 1) * numel]
    found["nccl"] = (lambda: dist.all_gather_into_tensor(out, inp, group=group), "")
    try:
        backend = group._get_backend(torch.device("cuda"))
        if not backend.supports_tensor_alloc(torch.device("cuda")):
            raise RuntimeError("the process group's backend has no allocator of its own")
        reg = backend.allocate_tensor(numel * world, dtype=torch.bfloat16, device=torch.device("cuda"))
        reg_in = reg[rank * numel:(rank + 1) * numel]
        found["nccl_registered"] = (lambda: dist.all_gather_into_tensor(reg, reg_in, group=group), "")
    except Exception as e:  # older torch or NCCL: say why
        found["nccl_registered"] = (None, f"{type(e).__name__}: {e}")
    try:
        import torch.distributed._symmetric_memory as symm_mem

        buf = symm_mem.empty(numel * world, device="cuda", dtype=torch.bfloat16)
        handle = symm_mem.rendezvous(buf, group)
        peers = [(p, handle.get_buffer(p, (numel * world,), torch.bfloat16)) for p in range(world) if p != rank]

        def copy_engine():
            for p, remote in peers:
                buf[p * numel:(p + 1) * numel].copy_(remote[p * numel:(p + 1) * numel], non_blocking=True)

        found["copy_engine"] = (copy_engine, "")
    except Exception as e:
        found["copy_engine"] = (None, f"{type(e).__name__}: {e}")
    return found


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shard_mib", type=int, default=336, help="One rank's shard of a unit (7 Qwen3-1.7B layers: 336).")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--iters", type=int, default=12)
    ap.add_argument("--chain", type=int, default=40, help="Gathers queued back to back on the side stream.")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("overlap_probe needs CUDA GPUs (run it under torchrun on one host).")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    dist.init_process_group("nccl", device_id=torch.device("cuda", torch.cuda.current_device()))
    group = dist.group.WORLD
    numel = args.shard_mib * (1 << 20) // 2
    side = torch.cuda.Stream()
    work = kernels(args.tokens)
    for _, fn in work:  # warm-up: kernels chosen, allocations made
        fn()
    alone = {}
    for name, fn in work:
        runs = time_each(fn, args.iters)
        torch.cuda.synchronize()
        alone[name] = statistics.median(s.elapsed_time(e) for s, e in runs)
    rows = []
    for way, (gather, reason) in ways(group, numel, world, rank).items():
        if gather is None:
            rows.append(f"| {way} | not available: {reason[:120]} | | | |")
            continue
        for _ in range(3):  # warm-up
            gather()
        dist.barrier()
        torch.cuda.synchronize()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(args.chain):
            gather()
        e.record()
        torch.cuda.synchronize()
        gbps = numel * 2 * (world - 1) * args.chain / (s.elapsed_time(e) / 1e3) / 1e9
        cells = []
        for name, fn in work:
            dist.barrier()
            torch.cuda.synchronize()
            begin = torch.cuda.Event(enable_timing=True)
            begin.record()
            with torch.cuda.stream(side):
                side.wait_event(begin)
                for _ in range(args.chain):
                    gather()
                chain_end = torch.cuda.Event(enable_timing=True)
                chain_end.record()
            runs = time_each(fn, args.iters)
            torch.cuda.synchronize()
            limit = begin.elapsed_time(chain_end)
            inside = [s_.elapsed_time(e_) for s_, e_ in runs if begin.elapsed_time(e_) <= limit]
            if inside:
                beside = statistics.median(inside)
                cells.append(f"{alone[name]:.3f} → {beside:.3f} ms ({beside / alone[name] - 1:+.0%}, n={len(inside)})")
            else:
                cells.append("gathers ended first")
        rows.append(f"| {way} | {gbps:.0f} GB/s | " + " | ".join(cells) + " |")
    if rank == 0:
        print(f"{world} GPUs ({torch.cuda.get_device_name()}), shard {args.shard_mib} MiB, {args.tokens} tokens, "
              f"torch {torch.__version__}, NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}")
        print("| gather | bandwidth alone | " + " | ".join(n for n, _ in work) + " |")
        print("|---|---|" + "---|" * len(work))
        print("\n".join(rows))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
