"""`fastdpo verify`: on your model and data, the gradients of one batch through every fast path and every activation
checkpointing policy, compared with the plain computation; and whether each policy really lowers
memory, naming the likely cause when it does not.

The plain path is the conventional padded batch through the model's own SDPA attention without checkpointing. The
reference is the plain path in float32: in bfloat16 / float16 the parameters are upcast for that one computation and
put back afterwards, bit for bit. Every path, the plain path in the model's dtype included, runs the same DPO loss
(sigmoid, reference log-probs from the plain path) and is compared with the reference per parameter group:
||g - g_ref|| / ||g_ref|| over the group's gradients. The plain path's own error in the model's dtype is the rounding
floor of that dtype on this model; a path passes when it is within FACTOR x that floor (never below the fixed
TOLERANCE of the dtype). A checkpointing policy must also give the same gradients as the same path without
checkpointing, within the fixed TOLERANCE of the dtype (recomputation reproduces the forward).

Memory: on CUDA the peak allocated during forward+backward; everywhere the bytes held for backward after the forward
(distinct storages autograd saved, parameters excluded, plus the inputs a checkpointed module keeps for recompute).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field

import torch

from fastdpo.config import checkpoint_policy
from fastdpo.data.load import load_rows
from fastdpo.data.pack import pack_pairs, pad_pairs, split_micro_batches
from fastdpo.data.tokenize import TokenizedPair
from fastdpo.losses import LossInputs, LossParams
from fastdpo.losses.with_reference import dpo_sigmoid_loss
from fastdpo.model.backend import Backend, choose_backend, prepare_packed, sequence_logps
from fastdpo.model.load import base_causal_lm, load_model, load_tokenizer, resolve_device, resolve_dtype
from fastdpo.model.memory import apply_checkpointing, compile_layers, decoder_layers

POLICIES = ("full", "ffn", "attn", "every:2")
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 1e-2}  # the minimum tolerance per dtype
TOLERANCE_BY_NAME = {str(k).removeprefix("torch."): v for k, v in TOLERANCE.items()}
FACTOR = 2  # a path may be at most this many times as far from float32 as the plain path in the same dtype
LOWERED = 0.97  # a policy "lowers memory" when it uses less than this fraction of the same path without it


@dataclass
class PathResult:
    name: str
    backend: str
    policy: str
    groups: dict[str, float]  # parameter group -> relative gradient difference (norm) to the reference
    tolerance: float  # bound on `worst`
    held_mib: float  # bytes held for backward after the forward
    peak_mib: float | None  # CUDA peak during forward+backward
    seconds: float
    dtype: str = "float32"  # the model's dtype, which every path runs in
    truth_dtype: str = "float32"  # dtype of the plain path that is the reference
    floor: float = 0.0  # the plain path's own worst error in `dtype` against the reference (0 when it is the reference)
    tolerance_from: str = "dtype"  # dtype: TOLERANCE[dtype]; floor: FACTOR x floor; user: --tolerance
    fallback: str = ""  # why the reference is not float32 (it did not fit in memory); empty when it is
    vs_no_ckpt: float | None = None  # policies only: worst group difference to the same path without checkpointing
    ckpt_tolerance: float | None = None  # policies only: bound on `vs_no_ckpt`
    lowered: bool | None = None  # policies only: memory below the same path without checkpointing
    causes: list[str] = field(default_factory=list)  # why not, when it was not lowered

    @property
    def worst(self) -> float:
        return max(self.groups.values()) if self.groups else 0.0

    @property
    def passed(self) -> bool:
        same = self.vs_no_ckpt is None or self.ckpt_tolerance is None or self.vs_no_ckpt <= self.ckpt_tolerance
        return self.worst <= self.tolerance and same


def param_group(name: str) -> str:
    n = name.lower()
    if "lm_head" in n:
        return "lm_head"
    if "embed" in n or "wte" in n:
        return "embed"
    if "norm" in n:
        return "norm"
    if "attn" in n or "attention" in n:
        return "attention"
    if "mlp" in n or "experts" in n or "feed_forward" in n:
        return "mlp"
    return "other"


def relative_differences(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> dict[str, float]:
    """Per parameter group: ||got - ref|| / ||ref|| over the group's gradients taken together."""
    diff: dict[str, float] = {}
    scale: dict[str, float] = {}
    for name, r in ref.items():
        g = param_group(name)
        diff[g] = diff.get(g, 0.0) + float(torch.linalg.vector_norm(got[name] - r)) ** 2
        scale[g] = scale.get(g, 0.0) + float(torch.linalg.vector_norm(r)) ** 2
    return {g: (diff[g] / scale[g]) ** 0.5 if scale[g] > 0 else diff[g] ** 0.5 for g in diff}


def tolerance_for(dtype: torch.dtype, floor: float, user: float | None = None) -> tuple[float, str]:
    """The bound on a path's error against the reference, and where it comes from: --tolerance when given, else
    FACTOR x the plain path's own error in `dtype`, never below TOLERANCE[dtype]."""
    if user is not None:
        return user, "user"
    if FACTOR * floor > TOLERANCE[dtype]:
        return FACTOR * floor, "floor"
    return TOLERANCE[dtype], "dtype"


class HeldForBackward:
    """Bytes of the distinct storages a forward leaves held for backward: tensors autograd saves (parameters
    excluded) and the inputs a checkpointed module keeps to recompute from. Works on any device."""

    def __init__(self, model: torch.nn.Module):
        self.params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.ckpt_modules = [m for m in model.modules() if getattr(m, "_fastdpo_ckpt", False)]
        self.storages: dict[int, int] = {}

    def _count(self, t) -> None:
        if isinstance(t, torch.Tensor):
            try:
                st = t.untyped_storage()
            except (RuntimeError, NotImplementedError):  # tensor subclasses without storage
                return
            if st.data_ptr() not in self.params:
                self.storages[st.data_ptr()] = st.nbytes()

    def _pack(self, t):
        self._count(t)
        return t

    def _pre_hook(self, module, args, kwargs):
        if torch.is_grad_enabled() and module.training:
            for a in list(args) + list(kwargs.values()):
                self._count(a)

    def __enter__(self) -> HeldForBackward:
        self.handles = [m.register_forward_pre_hook(self._pre_hook, with_kwargs=True) for m in self.ckpt_modules]
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self.hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.hooks.__exit__(*exc)
        for h in self.handles:
            h.remove()

    @property
    def mib(self) -> float:
        return sum(self.storages.values()) / 2**20


def no_saving_causes(model: torch.nn.Module, wrapped: list[str], longest_pair: int) -> list[str]:
    """The likely reasons a checkpointing policy did not lower memory: five known cases, a policy
    that wrapped nothing, and short sequences (§6.5)."""
    causes = []
    if not wrapped:
        causes.append("the policy wrapped no module: this model's decoder layers lack the .mlp / .self_attn it names")
    if getattr(model, "_orig_mod", None) is not None or any(
            getattr(m, "_compiled_call_impl", None) is not None for m in model.modules()):
        causes.append("torch.compile is applied around the checkpointed modules and can inline across their "
                      "boundaries (§6.1 case 1): compile inside the checkpointed regions, or compile without "
                      "mode='max-autotune'")
    if not torch.is_grad_enabled():
        causes.append("the forward ran under torch.no_grad (§6.1 case 2): nothing is kept for backward either way; "
                      "use .detach() on the values you do not differentiate instead")
    devices = {p.device for p in model.parameters()}
    if len(devices) > 1 or getattr(base_causal_lm(model), "hf_device_map", None):
        causes.append(f"device_map spread the layers over {sorted(map(str, devices))} (§6.1 case 3): checkpointed "
                      "recompute across devices keeps extra copies; place the model on one device")
    ckpt = [m for m in model.modules() if getattr(m, "_fastdpo_ckpt", False)]
    if any(not m.training for m in ckpt):
        causes.append("the model is in eval mode (§6.1 case 4): checkpointing is off outside model.train(); train in "
                      "train mode and evaluate under torch.no_grad")
    if any(type(m).__name__.startswith(("FSDP", "FullyShardedDataParallel")) for m in model.modules()):
        causes.append("FSDP wraps the model (§6.1 case 5): apply checkpointing per decoder layer before fully_shard "
                      "so the two wrap the same units")
    if not causes:
        causes.append(f"activations are a small share of memory at this length (the longest pair has {longest_pair} "
                      "tokens, §6.5): checkpointing pays off on long pairs; measure with real lengths (--max_length)")
    return causes


def _disable_dropout(model: torch.nn.Module) -> None:
    """Dropout would make every path differ; verification compares the deterministic computation."""
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
        if isinstance(getattr(m, "attention_dropout", None), float):
            m.attention_dropout = 0.0


def _gradients(model, pairs: list[TokenizedPair], backend: Backend, ref: torch.Tensor, budget: int,
               device: torch.device) -> tuple[dict[str, torch.Tensor], float, float | None]:
    """Gradients of the step's DPO loss over `pairs` (micro-batches under `budget` tokens, accumulated), the MiB held
    for backward by the largest micro-batch, and the CUDA peak."""
    model.zero_grad(set_to_none=True)
    n = len(pairs)
    position = {id(p): i for i, p in enumerate(pairs)}
    held = 0.0
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    for group in split_micro_batches(pairs, budget, n) if budget else [pairs]:
        idx = torch.tensor([position[id(p)] for p in group], device=device)
        if backend.name == "padded":
            batch = pad_pairs(group).to(device)
        else:
            batch = pack_pairs(group, 128 if backend.name == "flex" else 1).to(device)
        b = len(group)
        with HeldForBackward(model) as meter:
            pol, _ = sequence_logps(model, batch, backend)
            x = LossInputs(pol[:b], pol[b:], ref[idx], ref[n + idx], batch.lengths[:b], batch.lengths[b:])
            loss = dpo_sigmoid_loss(x, LossParams(beta=0.1)).sum() / n
        held = max(held, meter.mib)
        loss.backward()
    peak = None
    if cuda:
        torch.cuda.synchronize(device)
        peak = (torch.cuda.max_memory_allocated(device) - base) / 2**20
    grads = {name: p.grad.detach().float().clone() for name, p in model.named_parameters() if p.grad is not None}
    return grads, held, peak


def _out_of_memory(e: BaseException) -> bool:
    if isinstance(e, torch.OutOfMemoryError):
        return True
    text = str(e).lower()
    return isinstance(e, RuntimeError) and any(m in text for m in ("out of memory", "can't allocate memory",
                                                                   "not enough memory"))


def float32_gradients(model, pairs: list[TokenizedPair], ref: torch.Tensor,
                      device: torch.device) -> tuple[dict[str, torch.Tensor] | None, str]:
    """The plain path's gradients with the parameters upcast to float32 for this one computation (buffers such as
    rotary frequencies stay as they are): (gradients, ""), or (None, why) when float32 does not fit in memory. Either
    way every parameter is back in its own dtype afterwards, bit for bit: bfloat16 and float16 values round-trip
    through float32 exactly."""
    params = list(model.parameters())  # each shared (tied) parameter once
    dtypes = [p.dtype for p in params]
    model.zero_grad(set_to_none=True)
    try:
        for p in params:
            p.data = p.data.float()
        grads, _, _ = _gradients(model, pairs, Backend("padded"), ref.float(), 0, device)
        return grads, ""
    except RuntimeError as e:
        if not _out_of_memory(e):
            raise
        first = str(e).strip().splitlines()[0] if str(e).strip() else "out of memory"
        return None, f"float32 did not fit in memory ({first[:160]})"
    finally:
        model.zero_grad(set_to_none=True)  # float32 gradients on parameters about to be downcast
        for p, dtype in zip(params, dtypes):
            p.data = p.data.to(dtype)
        if device.type == "cuda":
            torch.cuda.empty_cache()


def load_pairs(model_path: str, datasets: list[str], num_pairs: int, max_length: int, seed: int,
               trust_remote_code: bool, template: str = "", system: str = "") -> list[TokenizedPair]:
    """The first `num_pairs` rows, tokenised as training does (chat template, system prompt, length limit)."""
    from types import SimpleNamespace

    from fastdpo.data.prepare import DataOptions, tokenize_pairs

    tokenizer = load_tokenizer(model_path, trust_remote_code)
    rows = load_rows(datasets, seed)[:num_pairs]
    opts = DataOptions.for_scoring(SimpleNamespace(max_length=max_length, seed=seed, template=template, system=system))
    return tokenize_pairs(rows, tokenizer, opts)[0]


def run_verify(model_path: str, datasets: list[str], num_pairs: int = 8, max_length: int = 512,
               device: str = "auto", torch_dtype: str = "float32", tolerance: float | None = None,
               policies: tuple[str, ...] = POLICIES, compile: bool | None = None, seed: int = 42,
               trust_remote_code: bool = False, template: str = "", system: str = "") -> list[PathResult]:
    """Run every path; the first result is the plain path in the model's dtype (in float32 the reference itself,
    differences 0; in bfloat16 / float16 its error is the floor that sets the tolerance). `tolerance` overrides the
    computed one; the bound on a policy's difference to the same path without checkpointing is TOLERANCE[dtype]."""
    for p in policies:
        checkpoint_policy(p, "policies")  # raises on a bad value
    dev = resolve_device(device)
    dtype = resolve_dtype(torch_dtype, dev)
    pairs = load_pairs(model_path, datasets, num_pairs, max_length, seed, trust_remote_code, template, system)
    model = load_model(model_path, dtype, dev, trust_remote_code)
    model.train()
    _disable_dropout(model)
    if dev.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False  # the float32 reference is float32 throughout
    with torch.no_grad():
        ref = sequence_logps(model, pad_pairs(pairs).to(dev), Backend("padded"))[0].detach()
    longest = max(p.num_tokens for p in pairs)
    budget = max(16, longest, sum(p.num_tokens for p in pairs) // 3)  # about three micro-batches

    fast = choose_backend(model, "auto", True, dev)
    paths: list[tuple[str, Backend, str, int, bool]] = []  # name, backend, policy, budget, compiled
    if fast.name != "padded":
        prepare_packed(model, fast)
        names = ["dense", "flex"] if dev.type == "cuda" else ["dense"]
        for b in names:
            paths.append((f"packed {b}", Backend(b, fast.window), "none", 0, False))
        paths.append((f"packed {fast.name}, budget {budget}", fast, "none", budget, False))
        if compile if compile is not None else dev.type == "cuda":
            paths.append((f"packed {fast.name}, compiled", fast, "none", 0, True))
    main = fast if fast.name != "padded" else Backend("padded")
    for p in policies:
        paths.append((f"ckpt {p}", main, p, 0, False))

    truth, fallback = (None, "") if dtype == torch.float32 else float32_gradients(model, pairs, ref, dev)
    t0 = time.perf_counter()
    plain, held, peak = _gradients(model, pairs, Backend("padded"), ref, 0, dev)
    seconds = time.perf_counter() - t0
    if truth is None:  # float32, or float32 did not fit: the plain path in the model's dtype is the reference
        truth = plain
    groups = relative_differences(plain, truth)
    floor = max(groups.values()) if groups else 0.0
    tol, tol_from = tolerance_for(dtype, floor, tolerance)
    dname = str(dtype).removeprefix("torch.")
    common = dict(dtype=dname, truth_dtype=dname if fallback else "float32", floor=floor, tolerance_from=tol_from,
                  fallback=fallback)
    results = [PathResult("plain (padded)", "padded", "none", groups, tol, held, peak, seconds, **common)]
    baseline: PathResult | None = None
    no_ckpt = plain  # gradients of the main path without checkpointing (the plain path until it has run)
    noise = 0.0  # how much that path differs from itself when run twice
    for name, backend, policy, micro_budget, compiled in paths:
        wrapped = apply_checkpointing(model, policy, reentrant=True)  # as training on one process
        if compiled:
            compile_layers(model)  # as --torch_compile does in training
        t0 = time.perf_counter()
        try:
            grads, held, peak = _gradients(model, pairs, backend, ref, micro_budget, dev)
        finally:
            if compiled:
                for layer in decoder_layers(model):
                    layer._compiled_call_impl = None
            apply_checkpointing(model, "none")
        r = PathResult(name, backend.name, policy, relative_differences(grads, truth), tol, held, peak,
                       time.perf_counter() - t0, **common)
        repeat: PathResult | None = None
        if policy == "none" and backend.name == main.name and not micro_budget and not compiled:
            baseline, no_ckpt = r, grads
            # the same path once more: its run-to-run difference (non-deterministic kernels, e.g. atomic adds in
            # backward) bounds how exactly recomputation can reproduce it
            t0 = time.perf_counter()
            again, held2, peak2 = _gradients(model, pairs, backend, ref, micro_budget, dev)
            repeat = PathResult(f"{name}, again", backend.name, "none", relative_differences(again, truth), tol,
                                held2, peak2, time.perf_counter() - t0, **common)
            diff = relative_differences(again, grads)
            noise = max(diff.values()) if diff else 0.0
            repeat.vs_no_ckpt = noise
        if policy != "none":
            same = relative_differences(grads, no_ckpt)
            r.vs_no_ckpt, r.ckpt_tolerance = max(same.values()) if same else 0.0, max(TOLERANCE[dtype], FACTOR * noise)
            base = baseline or results[0]
            mine, theirs = (r.peak_mib, base.peak_mib) if r.peak_mib is not None else (r.held_mib, base.held_mib)
            r.lowered = mine < LOWERED * theirs
            if not r.lowered:
                apply_checkpointing(model, policy, reentrant=True)
                r.causes = no_saving_causes(model, wrapped, longest)
                apply_checkpointing(model, "none")
        results.append(r)
        if repeat is not None:
            results.append(repeat)
    return results


def tolerance_text(r: PathResult) -> str:
    """Where the tolerance of `r` comes from, in words."""
    tol = f"tolerance {r.tolerance:.3g}"
    floor = f"the plain {r.dtype} path's own error {r.floor:.3g} against float32"
    if r.fallback:
        return (f"{tol}{' (--tolerance)' if r.tolerance_from == 'user' else ', fixed for ' + r.dtype}: NOT compared "
                f"with float32 because {r.fallback}; the reference is the plain {r.dtype} path, whose own rounding "
                "error is not known")
    if r.tolerance_from == "user":
        return f"{tol} (--tolerance)" + (f"; {floor}" if r.dtype != "float32" else "")
    if r.tolerance_from == "floor":
        return f"{tol} = {FACTOR:g} x {floor}"
    if r.dtype == "float32":
        return f"{tol} (float32: the plain path is the reference)"
    return f"{tol}, the minimum for {r.dtype} ({FACTOR:g} x {floor} is {FACTOR * r.floor:.3g})"


def print_results(results: list[PathResult], console, cuda: bool) -> None:
    from rich.markup import escape
    from rich.table import Table

    first = results[0]
    groups = sorted({g for r in results for g in r.groups})
    t = Table(title=f"{first.dtype} gradients vs the plain {first.truth_dtype} path: ||g - g_ref|| / ||g_ref|| per "
                    f"parameter group (tolerance {first.tolerance:.3g})")
    t.add_column("path")
    for g in groups:
        t.add_column(g, justify="right")
    t.add_column("= no ckpt", justify="right")
    t.add_column("result")
    t.add_column("held MiB", justify="right")
    if cuda:
        t.add_column("peak MiB", justify="right")
    t.add_column("lowered?")
    t.add_column("s", justify="right")
    for r in results:
        verdict = "[green]PASS[/]" if r.passed else "[bold red]FAIL[/]"
        lowered = "" if r.lowered is None else ("yes" if r.lowered else "[yellow]no[/]")
        same = "" if r.vs_no_ckpt is None else f"{r.vs_no_ckpt:.1e}"
        if r.vs_no_ckpt is not None and r.ckpt_tolerance is not None and r.vs_no_ckpt > r.ckpt_tolerance:
            same = f"[bold red]{same}[/]"
        row = [r.name] + [f"{r.groups.get(g, 0.0):.1e}" for g in groups] + [same, verdict, f"{r.held_mib:.2f}"]
        if cuda:
            row.append(f"{r.peak_mib:.1f}" if r.peak_mib is not None else "-")
        t.add_row(*row, lowered, f"{r.seconds:.2f}")
    width = console.width
    console.width = max(width, 120)  # the table is wider than a default 80-column pipe; let it be
    console.print(t)
    console.width = width
    console.print(("[yellow]" if first.fallback else "") + escape(tolerance_text(first)) + ".", highlight=False)
    ckpt = [r for r in results if r.ckpt_tolerance is not None]
    again = next((r for r in results if r.vs_no_ckpt is not None and r.ckpt_tolerance is None), None)
    notes = []
    if ckpt:
        notes.append(f"ckpt: activation checkpointing policies on the {ckpt[0].backend} path; = no ckpt: a policy's "
                     "difference to the same path without checkpointing, which recomputation must reproduce within "
                     f"{ckpt[0].ckpt_tolerance:.3g}"
                     + (f" (the larger of {TOLERANCE_BY_NAME.get(first.dtype, 0):g} and {FACTOR:g} x the "
                        f"{again.vs_no_ckpt:.2g} by which that path differs from itself, run again)" if again else ""))
    notes.append("held MiB: bytes kept for backward after the forward (largest micro-batch)"
                 + ("; peak MiB: CUDA peak during forward+backward" if cuda else "")
                 + ("; lowered?: a policy uses less than the same path without checkpointing" if ckpt else ""))
    console.print(". ".join(notes) + ".", highlight=False)
    for r in results:
        for c in r.causes:
            console.print(f"[yellow]{r.name}[/]: memory not lowered; likely cause: {c}.", highlight=False)
    failed = [r.name + ("" if r.worst <= r.tolerance else f" ({r.worst:.2g} from {r.truth_dtype})")
              + ("" if r.passed or r.worst > r.tolerance else " (differs from the path without checkpointing)")
              for r in results if not r.passed]
    compared = len(results) - (1 if first.dtype == first.truth_dtype else 0)  # the plain path itself is not compared
    if failed:
        console.print(f"[bold red]FAIL[/]: {', '.join(failed)}", highlight=False)
    else:
        console.print(f"[bold green]PASS[/]: {compared} paths match the plain {first.truth_dtype} path within "
                      f"{first.tolerance:.3g}.", highlight=False)


def results_json(results: list[PathResult]) -> list[dict]:
    return [{**dataclasses.asdict(r), "worst": r.worst, "passed": r.passed} for r in results]
