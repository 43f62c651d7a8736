"""The policy's completion log-prob forward as one module (`LogpsModule`), so DDP/FSDP2 hooks see the whole
computation; wrapped in DDP or sharded with FSDP2 `fully_shard` per unit of decoder layers (`unit_sizes`), the
reference likewise; gradient sync deferred to the last micro-step (`grad_sync`); the full state dict gathered on
rank 0 for saving.

Gradients are *summed* across ranks (not averaged): every rank divides its loss by the pairs of the whole step, so
the sum is the gradient of the global mean, exactly as one process with all pairs would compute it."""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging

import torch

from fastdpo.parallel.distributed import Dist

log = logging.getLogger("fastdpo")


class LogpsModule(torch.nn.Module):
    """`completion_logps` as one module forward: DDP and FSDP2 attach their hooks to module calls, and our forward
    runs the decoder and then reads the output head's weight directly (chunked log-probs), so the whole
    computation must sit inside one call. Parameters are the wrapped model's (FQNs gain a `model.` prefix).
    Returns a tuple of the SeqLogps fields in order (the wrappers find tensors in tuples, not in our dataclass);
    `policy_logps` rebuilds SeqLogps. `reference` runs the LoRA reference on this same module without grad:
    `adapter_off` or `ref_adapter` (the reference needs no prompt targets: no NLL is taken of it)."""

    def __init__(self, model: torch.nn.Module, backend):
        super().__init__()
        self.model = model
        self.backend = backend

    def forward(self, batch, mask, wpo: bool = False, reference: str = "", prompt: bool = True):
        from fastdpo.dpo.reference import REF_ADAPTER, active_adapter
        from fastdpo.model.seqlogps import completion_logps

        if not reference:
            out = completion_logps(self.model, batch, self.backend, mask, wpo, prompt)
        else:
            off = reference == "adapter_off"
            with torch.no_grad(), (self.model.disable_adapter() if off else active_adapter(self.model, REF_ADAPTER)):
                out = completion_logps(self.model, batch, self.backend, mask, wpo, prompt=False)
        return out.sums, out.shared, out.wpo, out.prompt


def policy_logps(module: torch.nn.Module, batch, mask, wpo: bool = False, reference: str = "", prompt: bool = True):
    """SeqLogps of a batch through a LogpsModule, plain or wrapped in DDP / FSDP2 (`prompt`: with the batch's prompt
    targets, when it carries them)."""
    from fastdpo.model.seqlogps import SeqLogps

    return SeqLogps(*module(batch, mask, wpo, reference, prompt))


def _sum_across_ranks(widen: bool, bucket):
    """DDP comm hook: sum (not average) the gradient bucket across ranks; a bfloat16/float16 bucket in a float32 copy
    when `widen` (`Dist.sum_in_fp32`), else in place."""
    import torch.distributed as dist

    buf = bucket.buffer()
    wide = buf.float() if widen and buf.dtype != torch.float32 else buf
    fut = dist.all_reduce(wide, async_op=True).get_future()

    def done(f):
        if wide is not buf:
            buf.copy_(f.value()[0])
        return buf

    return fut.then(done)


UNIT_MIB = 768  # auto FSDP2 units: consecutive decoder layers up to this many MiB of weights each


def unit_sizes(layers, requested: int = 0) -> list[int]:
    """Decoder layers per FSDP2 unit, in order: units of at most `requested` layers (--fsdp_layers_per_unit), or
    with 0 of at most UNIT_MIB of weights (at least one layer), as few units as that allows and of equal size within
    one layer (28 layers of 96 MiB: four units of 7, not 8, 8, 8, 4). A unit's hooks run on the host once per forward
    and backward whatever its size, and at small micro-batches the ranks wait on those hooks (benchmarks/NOTES.md
    entries 19, 20, 25); under full_shard a larger unit holds more gathered weights at once (the unit computing and
    the one prefetched)."""
    if not len(layers):
        return []
    most = requested or (UNIT_MIB << 20) // max(sum(p.numel() * p.element_size() for p in layers[0].parameters()), 1)
    units = -(-len(layers) // max(most, 1))
    return [len(layers) // units + (i < len(layers) % units) for i in range(units)]


def _shard(module: LogpsModule, d: Dist, reshard: bool, training: bool = True) -> list[int]:
    """FSDP2: one unit per `unit_sizes` consecutive decoder layers plus the root (embeddings, final norm, head);
    gradients summed (not averaged) in float32 or in their own dtype (`Dist.sum_in_fp32`). A unit's weights are
    gathered and its gradients reduced together, and its hooks run once per forward and backward. With `reshard`
    (full_shard) and `training`, the last decoder unit and the root stay gathered from their forward into the
    backward that starts right after it (otherwise both are freed and gathered again at once, the root's gather
    exposed); a forward-only module (the reference) frees every unit after its forward."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    from fastdpo.model.memory import decoder_layers

    device_type = "cuda" if next(module.parameters()).is_cuda else "cpu"
    mesh = init_device_mesh(device_type, (d.world_size,))
    mp = MixedPrecisionPolicy(reduce_dtype=torch.float32 if d.sum_in_fp32 else None)
    layers = decoder_layers(module.model)
    start, sizes = 0, unit_sizes(layers, d.layers_per_unit)
    units = []  # in forward order
    for i, size in enumerate(sizes):
        unit, start = layers[start : start + size], start + size
        keep = training and i == len(sizes) - 1
        sharded = fully_shard(unit if len(unit) > 1 else unit[0], mesh=mesh,
                              reshard_after_forward=reshard and not keep, mp_policy=mp)
        units.append(sharded[0] if isinstance(sharded, list) else sharded)  # a list shares one state
    fully_shard(module, mesh=mesh, reshard_after_forward=reshard and not training, mp_policy=mp)
    # each forward gathers the next unit as it opens (the root: the first unit), so that gather runs under this unit's
    # compute even when the host is behind the device; left to the next unit's own hook, it is issued only when the
    # host reaches that unit, and the device waits on it. A no-op for a unit already gathered.
    for unit, after in zip([module, *units], units):
        unit.set_modules_to_forward_prefetch([after])
    # full_shard: the root and the first unit open every forward; between a step's micro-batches (grad_sync) they
    # stay gathered instead of being freed by one backward and gathered again, exposed, by the next forward. No peak
    # is added: nothing else is held at a micro-batch boundary, and both are gathered again right after it.
    module._fastdpo_boundary_units = (module, *units[:1]) if reshard and training else ()
    for m in module.modules():
        if isinstance(m, FSDPModule):
            if hasattr(m, "set_gradient_divide_factor"):  # torch >= 2.8
                m.set_gradient_divide_factor(1.0)
                m.set_force_sum_reduction_for_comms(True)
            else:  # torch 2.6 / 2.7: the same setting under its earlier name
                m.set_reduce_scatter_divide_factor(1.0)
    return sizes


def wrap_models(model: torch.nn.Module, reference, backend, d: Dist) -> torch.nn.Module:
    """The policy forward module for the loop (plain, DDP or FSDP2). Under FSDP2 the reference is sharded too and
    `reference.runner` is set so its forward goes through the sharded module."""
    policy = LogpsModule(model, backend)
    if d.mode == "single":
        return policy
    if d.mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        on_cuda = next(model.parameters()).is_cuda
        # buffers (rotary tables) are equal on every rank: no sync before each forward (torch >= 2.13 calls this
        # forward_sync_buffers and warns on the old name); gradients are views into the reduction buckets, so the
        # reducer does not keep a second copy of them
        sync = "forward_sync_buffers" if "forward_sync_buffers" in inspect.signature(DDP).parameters \
            else "broadcast_buffers"
        policy = DDP(policy, device_ids=[d.local_rank] if on_cuda else None, gradient_as_bucket_view=True,
                     **{sync: False})
        policy.register_comm_hook(d.sum_in_fp32, _sum_across_ranks)
        return policy
    sizes = _shard(policy, d, d.reshard_after_forward)
    log.info("FSDP2 units: %d of %s decoder layers, and the root (--fsdp_layers_per_unit).", len(sizes),
             "/".join(map(str, sorted(set(sizes), reverse=True))))
    _accumulate_in_param_dtype(policy)
    if reference.strategy in ("copy", "separate"):
        ref = LogpsModule(reference.model, backend)
        _shard(ref, d, reshard=True, training=False)
        reference.runner = functools.partial(policy_logps, ref, prompt=False)
    elif reference.strategy in ("adapter_off", "ref_adapter"):
        reference.runner = functools.partial(policy_logps, policy, reference=reference.strategy)
    return policy


@contextlib.contextmanager
def grad_sync(policy: torch.nn.Module, last: bool, keep_gathered: bool = False):
    """Reduce gradients across ranks only on the last micro-step of an optimizer step. With `keep_gathered` (FSDP2
    shard_grad_op, i.e. ZeRO-2), the weights gathered by the step's first forward also stay gathered after the
    backwards of its other micro-steps: one all-gather per optimizer step instead of one per micro-batch, at no extra
    peak memory (shard_grad_op holds every layer's gathered weights between forward and backward anyway). FSDP2's
    deferred gradients accumulate in the parameters' dtype, like DDP's and one process's (`_accumulate_in_param_dtype`).
    Under full_shard the root and the first decoder unit stay gathered between micro-steps (`_shard`)."""
    from torch.distributed.fsdp import FSDPModule
    from torch.nn.parallel import DistributedDataParallel as DDP

    if isinstance(policy, DDP) and not last:
        with policy.no_sync():
            yield
        return
    if isinstance(policy, FSDPModule):
        policy.set_requires_gradient_sync(last)
        if keep_gathered:
            policy.set_reshard_after_backward(last)
        for unit in getattr(policy, "_fastdpo_boundary_units", ()):  # full_shard (`_shard`)
            unit.set_reshard_after_backward(last, recurse=False)
    yield


def gather_step_start(policy: torch.nn.Module) -> list:
    """full_shard: start gathering the root and the first decoder unit, which every step's first forward opens with
    and which the step's last backward sharded for the optimizer. Called right after the update is queued (the
    gathers read the updated shards: FSDP2 orders them after it) when another step follows: the gathers run under the
    host's work between steps (the flag read, logging, a checkpoint or an evaluation, packing the next micro-batches)
    instead of, exposed, in the next forward, whose pre-forward hooks wait on them. Not before the first forward,
    where FSDP2 sets up its streams. Returns the handles (none for other modes). No peak is added: nothing else is
    held between steps, and the next forward gathers both at once anyway."""
    return [unit.unshard(async_op=True) for unit in getattr(policy, "_fastdpo_boundary_units", ())]


def _accumulate_in_param_dtype(module: torch.nn.Module) -> None:
    """Deferred FSDP2 micro-steps accumulate their unsharded gradients in the parameters' dtype, as one process and
    DDP do; the reduction on the last micro-step runs in the reduce dtype (float32 unless `Dist.sum_in_fp32` is off).
    Left alone, FSDP2 copies each gradient to the reduce dtype after every deferred backward and adds there: a cast
    and a float32 add per parameter and micro-step, and a float32 copy of the whole model's gradients held through
    the step. The per-parameter reduce dtype (read only by that copy) is cleared; the groups', which the
    reduce-scatter uses, stays. FSDP2 sets both at its lazy initialisation, which the first forward would run: it runs
    here instead, once. On a torch whose FSDP2 keeps these elsewhere, nothing changes (float32 accumulation, slower)."""
    init = getattr(getattr(module, "_get_fsdp_state", lambda: None)(), "_lazy_init", None)
    if init is None:
        return
    init()
    states = {id(st): st for m in module.modules() if (st := getattr(m, "_get_fsdp_state", lambda: None)())}
    for state in states.values():  # a unit of several layers has one state
        groups = getattr(state, "_fsdp_param_groups", None)
        if groups is None:  # earlier torch: one group per module
            groups = [getattr(state, "_fsdp_param_group", None)]
        for group in groups:
            for fp in getattr(group, "fsdp_params", ()):
                if getattr(fp, "reduce_dtype", None) is not None:
                    fp.reduce_dtype = None


def full_state_dict(model: torch.nn.Module, d: Dist) -> dict | None:
    """Under FSDP2, gather the full weights onto rank 0's CPU (every rank must call); otherwise None (the model's
    own parameters are whole)."""
    if d.mode != "fsdp":
        return None
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    lora = hasattr(model, "peft_config")  # only the adapters are saved: do not gather the frozen base
    options = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=lora)
    full = get_model_state_dict(model, options=options)
    # tied weights (embeddings = output head) arrive as separate copies: share them again so save_pretrained
    # recognises the tie and writes the usual single tensor
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    for group in names.values():
        present = [n for n in group if n in full]
        for n in present[1:]:
            full[n] = full[present[0]]
    return full
