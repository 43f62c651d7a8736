"""`fastdpo env`: versions, GPUs, and the NCCL variables that matter, with advice on NCCL_P2P_DISABLE /
NCCL_IB_DISABLE:

- one node, GPUs in one PCIe domain, no InfiniBand: at most NCCL_P2P_DISABLE=1 (and only when peer access is broken,
  e.g. consumer cards); never needed with NVLink, where it slows communication;
- one node with InfiniBand: set neither, NCCL detects what it has;
- several nodes: InfiniBand must work: never NCCL_IB_DISABLE=1, or gradients crawl over TCP.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import sys
from pathlib import Path

NCCL_VARS = ("NCCL_P2P_DISABLE", "NCCL_IB_DISABLE", "NCCL_P2P_LEVEL", "NCCL_SOCKET_IFNAME", "NCCL_DEBUG",
             "NCCL_NET_GDR_LEVEL", "NCCL_NVLS_ENABLE", "TORCH_NCCL_ASYNC_ERROR_HANDLING", "NCCL_ASYNC_ERROR_HANDLING",
             "TORCH_NCCL_BLOCKING_WAIT", "TORCH_NCCL_ENABLE_MONITORING", "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC")
LAUNCH_VARS = ("CUDA_VISIBLE_DEVICES", "WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "NNODES", "MASTER_ADDR",
               "MASTER_PORT")
# torch.compile's own settings read from the environment (Inductor's C++ wrapper, caches, autotuning...): they change
# compile time and speed, so runs and benchmarks record the ones set
COMPILE_PREFIXES = ("TORCHINDUCTOR_", "TORCHDYNAMO_", "TORCH_COMPILE_")
COMPILE_UNRECORDED = ("TORCHINDUCTOR_CACHE_DIR",)  # only where compiled code is kept; Inductor sets it itself
PACKAGES = ("torch", "transformers", "peft", "safetensors", "datasets", "tokenizers", "accelerate", "rich", "pyyaml",
            "numpy", "matplotlib", "tensorboard", "wandb", "bitsandbytes", "flash-attn")


def compile_vars(env: dict | None = None) -> dict[str, str]:
    """The torch.compile variables set in `env` (default: this process's environment), sorted by name."""
    env = os.environ if env is None else env
    return {k: env[k] for k in sorted(env) if k.startswith(COMPILE_PREFIXES) and k not in COMPILE_UNRECORDED}


def as_assignments(variables: dict[str, str]) -> str:
    """`A=1  B=x`: variables as they would be set in a shell."""
    return "  ".join(f"{k}={v}" for k, v in variables.items())


def package_versions() -> dict[str, str | None]:
    out = {}
    for name in PACKAGES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def gpu_facts() -> list[dict]:
    import torch

    if not torch.cuda.is_available():
        return []
    gpus = []
    n = torch.cuda.device_count()
    for i in range(n):
        p = torch.cuda.get_device_properties(i)
        peers = [j for j in range(n) if j != i and torch.cuda.can_device_access_peer(i, j)]
        gpus.append({"index": i, "name": p.name, "memory_gib": round(p.total_memory / 2**30, 1),
                     "capability": f"{p.major}.{p.minor}", "peer_access": peers})
    return gpus


def has_infiniband(root: str = "/sys/class/infiniband") -> bool:
    p = Path(root)
    return p.is_dir() and any(p.iterdir())


def node_count(env: dict) -> int:
    """Nodes in the launch: NNODES, else WORLD_SIZE / LOCAL_WORLD_SIZE, else 1."""
    try:
        if env.get("NNODES"):
            return max(1, int(env["NNODES"].split(":")[-1]))
        if env.get("WORLD_SIZE") and env.get("LOCAL_WORLD_SIZE"):
            return max(1, int(env["WORLD_SIZE"]) // max(1, int(env["LOCAL_WORLD_SIZE"])))
    except ValueError:
        pass
    return 1


def nccl_advice(env: dict, gpus: list[dict], infiniband: bool, nodes: int) -> list[str]:
    """Advice on the NCCL variables for this machine and launch (pure: facts in, sentences out)."""
    p2p_off = env.get("NCCL_P2P_DISABLE") == "1"
    ib_off = env.get("NCCL_IB_DISABLE") == "1"
    full_peer = len(gpus) > 1 and all(len(g["peer_access"]) == len(gpus) - 1 for g in gpus)
    consumer = any("RTX" in g["name"] or "GeForce" in g["name"] for g in gpus)
    advice = []
    if nodes > 1:
        if ib_off:
            advice.append(f"NCCL_IB_DISABLE=1 on a {nodes}-node launch: gradients go over TCP sockets. Unset it and make "
                          "sure InfiniBand works; set --master_port explicitly.")
        elif not infiniband:
            advice.append("Several nodes but no InfiniBand device here: inter-node traffic uses TCP; expect slow "
                          "all-reduce, and set NCCL_SOCKET_IFNAME to the fast interface.")
    elif ib_off:
        where = "although this node has InfiniBand" if infiniband else "on one node without InfiniBand"
        advice.append(f"NCCL_IB_DISABLE=1 {where}: it changes nothing here, but remove it before going multi-node.")
    if p2p_off and full_peer:
        advice.append("NCCL_P2P_DISABLE=1 although every GPU can reach every other directly (NVLink or one PCIe "
                      "switch): this slows communication (30% or more). Unset it unless it fixes a real error.")
    if not p2p_off and len(gpus) > 1 and not full_peer:
        advice.append("Some GPU pairs have no peer access (different PCIe root complexes, or consumer cards): if NCCL "
                      "hangs or fails with cudaErrorInvalidValue, set NCCL_P2P_DISABLE=1.")
    if not p2p_off and consumer and len(gpus) > 1:
        advice.append("Consumer GPUs (GeForce/RTX) in one node: NCCL_P2P_DISABLE=1 is usually needed.")
    if not advice and nodes == 1 and not p2p_off:
        advice.append("Single node: leave NCCL_P2P_DISABLE and NCCL_IB_DISABLE unset unless NCCL reports an error.")
    elif not advice:
        advice.append("These NCCL settings fit this machine and launch.")
    if env.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", env.get("NCCL_ASYNC_ERROR_HANDLING")) == "0":
        advice.append("Async NCCL error handling is off: a hung collective will never raise. Unset it (--ddp_timeout "
                      "then bounds the wait).")
    return advice


def collect(env: dict | None = None) -> dict:
    import torch

    env = dict(os.environ if env is None else env)
    cuda = torch.version.cuda
    nccl = None
    if torch.cuda.is_available() and hasattr(torch.cuda, "nccl"):
        try:
            nccl = ".".join(map(str, torch.cuda.nccl.version()))
        except (RuntimeError, AttributeError):
            nccl = None
    gpus = gpu_facts()
    ib = has_infiniband()
    nodes = node_count(env)
    from fastdpo.version import __version__

    return {
        "fastdpo": __version__, "python": sys.version.split()[0], "platform": platform.platform(),
        "packages": package_versions(), "cuda": cuda, "cudnn": torch.backends.cudnn.version() if cuda else None,
        "nccl": nccl, "gpus": gpus, "infiniband": ib, "nodes": nodes,
        "nccl_env": {k: env[k] for k in NCCL_VARS if k in env},
        "launch_env": {k: env[k] for k in LAUNCH_VARS if k in env},
        "compile_env": compile_vars(env),
        "advice": nccl_advice(env, gpus, ib, nodes),
    }


def print_env(info: dict, console) -> None:
    from rich.table import Table

    console.print(f"[bold]fastdpo {info['fastdpo']}[/]  python {info['python']}  {info['platform']}", highlight=False)
    t = Table(title="packages", show_header=False)
    for k, v in info["packages"].items():
        t.add_row(k, v or "[dim]not installed[/]")
    t.add_row("CUDA / cuDNN / NCCL", f"{info['cuda'] or '-'} / {info['cudnn'] or '-'} / {info['nccl'] or '-'}")
    console.print(t)
    if info["gpus"]:
        g = Table(title="GPUs")
        for col in ("index", "name", "memory (GiB)", "capability", "peer access to"):
            g.add_column(col)
        for d in info["gpus"]:
            g.add_row(str(d["index"]), d["name"], str(d["memory_gib"]), d["capability"],
                      ",".join(map(str, d["peer_access"])) or "-")
        console.print(g)
    else:
        console.print("GPUs: none visible (CPU only).")
    console.print(f"InfiniBand: {'yes' if info['infiniband'] else 'no'}   nodes in this launch: {info['nodes']}")
    n = Table(title="NCCL and launch variables", show_header=False)
    for k in NCCL_VARS + LAUNCH_VARS:
        v = info["nccl_env"].get(k, info["launch_env"].get(k))
        n.add_row(k, v if v is not None else "[dim]unset[/]")
    console.print(n)
    compile_env = info.get("compile_env") or {}
    console.print("torch.compile variables: " + (as_assignments(compile_env) or "none set"), highlight=False)
    for a in info["advice"]:
        console.print(f"[yellow]advice:[/] {a}", highlight=False)
