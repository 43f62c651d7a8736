"""Activation checkpointing policies (DESIGN §7): none, full (per decoder layer), ffn (MLP only), attn (attention
only), every:K (every K-th decoder layer). Torch's non-reentrant form, so keyword inputs and frozen inputs work; on
one process, regions that serve it recompute in the lighter reentrant form (`_Recomputed`)."""

from __future__ import annotations

import contextlib
import contextvars

import torch
from torch.utils.checkpoint import checkpoint

from fastdpo.config import checkpoint_policy
from fastdpo.errors import FastDPOError

_RECOMPUTING = contextvars.ContextVar("fastdpo_recomputing", default=False)


def recomputing() -> bool:
    """Whether this forward is a checkpointed region's recompute in the backward: only what it saves for the backward
    is kept (its outputs are discarded), so work that only feeds the outputs can be skipped."""
    return _RECOMPUTING.get()


def _recompute_marked(forward):
    """`forward` for one checkpointed call: its second run (the recompute) is marked (`recomputing`)."""
    runs = 0

    def run(*args, **kwargs):
        nonlocal runs
        runs += 1
        if runs == 1:
            return forward(*args, **kwargs)
        token = _RECOMPUTING.set(True)
        try:
            return forward(*args, **kwargs)
        finally:
            _RECOMPUTING.reset(token)

    return run


def _rng_states(device: torch.device) -> tuple:
    """The generators' states a region's forward starts from: the CPU's, and its CUDA device's."""
    return torch.get_rng_state(), torch.cuda.get_rng_state(device) if device.type == "cuda" else None


@contextlib.contextmanager
def _replayed(states: tuple | None, device: torch.device):
    """Run the block from the generators' `states` (None: as they are), leaving them as they were after it."""
    if states is None:
        yield
        return
    cuda = device.type == "cuda"
    with torch.random.fork_rng(devices=[device.index if device.index is not None else torch.cuda.current_device()]
                               if cuda else []):
        torch.set_rng_state(states[0])
        if cuda:
            torch.cuda.set_rng_state(states[1], device)
        yield


class _Recomputed(torch.autograd.Function):
    """`run(hidden)` computed without a graph, and again with one in the backward, where its graph is walked at
    once (checkpointing's reentrant form). The non-reentrant form records the forward's graph and passes every
    tensor it saves through hooks, twice: on a 28-layer model that host work made each step wait on the CPU, not on
    the GPU. For a region whose grads flow through `hidden` alone; `rng`: the region draws random numbers (dropout),
    so the recompute starts from the generators' states of the forward and draws the same masks."""

    @staticmethod
    def forward(ctx, run, rng: bool, hidden: torch.Tensor) -> torch.Tensor:
        ctx.run = run
        ctx.rng = _rng_states(hidden.device) if rng else None
        ctx.save_for_backward(hidden)
        return run(hidden)  # autograd records nothing inside a Function's forward

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        if not torch.autograd._is_checkpoint_valid():  # the recompute's grads land in .grad, not in grad()'s result
            raise RuntimeError("fastdpo's checkpointed layers take loss.backward(), not torch.autograd.grad() or "
                               "backward(inputs=...): use --gradient_checkpointing none for those.")
        create_graph = torch.is_grad_enabled()  # backward(create_graph=True)
        (hidden,) = ctx.saved_tensors
        run, ctx.run = ctx.run, None  # nothing of the layer outlives its backward
        x = hidden.detach().requires_grad_()
        token = _RECOMPUTING.set(True)
        try:
            with _replayed(ctx.rng, hidden.device), torch.enable_grad():
                out = run(x)
        finally:
            _RECOMPUTING.reset(token)
        torch.autograd.backward(out, grad, create_graph=create_graph)
        return None, None, x.grad


def _grad_elsewhere(values) -> bool:
    """Whether any tensor among `values` (one level into tuples and lists) requires grad."""
    for v in values:
        for t in (v if isinstance(v, (tuple, list)) else (v,)):
            if isinstance(t, torch.Tensor) and t.requires_grad:
                return True
    return False


def _recompute_reentrant(forward, args: tuple, kwargs: dict, rng: bool = False):
    """`forward(*args, **kwargs)` through `_Recomputed`, or None where that form does not serve this call: the
    hidden states (the first argument, or `hidden_states=`) must carry the grads, nothing else may need them, and no
    cache may be passed (the recompute would append to it again)."""
    by_name = not args and "hidden_states" in kwargs
    hidden = kwargs.get("hidden_states") if by_name else args[0] if args else None
    others = (*args[1:], *(v for k, v in kwargs.items() if not (by_name and k == "hidden_states")))
    if (not (isinstance(hidden, torch.Tensor) and hidden.requires_grad) or _grad_elsewhere(others)
            or any(kwargs.get(k) is not None for k in ("past_key_values", "past_key_value", "cache"))):
        return None
    rest = []
    # the closure lives as long as the backward graph's node, so it holds the other arguments only: the hidden states
    # are saved (and released once the layer's backward has run); a closure over them would keep every layer's
    # until the whole backward ended
    other_args = args[1:]
    other_kwargs = {k: v for k, v in kwargs.items() if not (by_name and k == "hidden_states")}

    def run(h: torch.Tensor) -> torch.Tensor:
        out = forward(hidden_states=h, **other_kwargs) if by_name else forward(h, *other_args, **other_kwargs)
        if isinstance(out, tuple):  # (hidden_states, extras...): attention weights, older layers' extras
            rest[:] = out[1:]
            out = out[0]
        return out

    out = _Recomputed.apply(run, rng, hidden)
    return (out, *rest) if rest else out


def draws_random(module: torch.nn.Module) -> bool:
    """Whether the module's training forward may draw random numbers (a dropout with p > 0, attention dropout)."""
    for m in module.modules():
        if isinstance(m, torch.nn.modules.dropout._DropoutNd) and m.p > 0:
            return True
        p = getattr(m, "attention_dropout", 0.0)  # a probability (a module is caught above)
        if isinstance(p, (int, float)) and p > 0:
            return True
    return False


def _wrap(module: torch.nn.Module, reentrant: bool = False) -> None:
    if getattr(module, "_fastdpo_ckpt", False):
        return
    forward = module.forward
    rng = draws_random(module)

    def checkpointed(*args, **kwargs):
        if not (torch.is_grad_enabled() and module.training):
            return forward(*args, **kwargs)
        if torch.compiler.is_compiling():  # a compiled region is traced once: nothing to mark
            return checkpoint(forward, *args, use_reentrant=False, **kwargs)
        if reentrant and (out := _recompute_reentrant(forward, args, kwargs, rng)) is not None:
            return out
        return checkpoint(_recompute_marked(forward), *args, use_reentrant=False, **kwargs)

    module._fastdpo_unwrapped = module.__dict__.get("forward")  # an instance forward (`fused`) comes back unwrapped
    module.forward = checkpointed
    module._fastdpo_ckpt = True


def _unwrap(module: torch.nn.Module) -> None:
    if getattr(module, "_fastdpo_ckpt", False):
        del module.forward
        if module._fastdpo_unwrapped is not None:
            module.forward = module._fastdpo_unwrapped
        module._fastdpo_ckpt = False


def decoder_layers(model) -> list[torch.nn.Module]:
    from fastdpo.model.backend import decoder

    return list(decoder(model).layers)


def apply_checkpointing(model, policy: str, reentrant: bool = False) -> list[str]:
    """Wrap modules per `policy`; returns the names of what got wrapped (for logs and tests). `reentrant`: recompute
    the regions in checkpointing's reentrant form (`_Recomputed`: less host work per layer), where their hidden states
    carry the grads (a region with dropout replays its generators' states); for one process, whose backward no DDP
    or FSDP2 hooks follow."""
    name, k = checkpoint_policy(policy)
    layers = decoder_layers(model)
    wrapped = []
    for i, layer in enumerate(layers):
        for m in (layer, getattr(layer, "mlp", None), getattr(layer, "self_attn", None)):
            if m is not None:
                _unwrap(m)
        if name == "full" or (name == "every" and i % k == 0) or (name == "keep" and i < len(layers) - k):
            _wrap(layer, reentrant)
            wrapped.append(f"layers.{i}")
        elif name == "ffn":
            _wrap(layer.mlp, reentrant)
            wrapped.append(f"layers.{i}.mlp")
        elif name == "attn":
            _wrap(layer.self_attn, reentrant)
            wrapped.append(f"layers.{i}.self_attn")
    for i, block in enumerate(vision_blocks(model)):
        _unwrap(block)
        if name != "none" and trains(block):
            _wrap(block, reentrant)
            wrapped.append(f"vision.{i}")
    return wrapped


def vision_blocks(model) -> list[torch.nn.Module]:
    """The repeated blocks of a vision-language model's vision tower (Qwen2-VL to Qwen3-VL: `visual.blocks`; LLaVA's
    CLIP: its encoder's layers); none for a text model. A trained tower keeps each block's activations for the
    backward, per patch (about four patches per visual token), so checkpointing wraps them with the decoder's layers
    (under any policy but `none`), as transformers' gradient checkpointing does."""
    from fastdpo.model.vlm_parts import vision_tower

    found = vision_tower(model)
    if found is None:
        return []
    tower = found[0]
    if hasattr(tower, "blocks"):
        return list(tower.blocks)
    encoder = getattr(getattr(tower, "vision_model", tower), "encoder", None)
    return list(getattr(encoder, "layers", []))


def trains(module: torch.nn.Module) -> bool:
    """Whether any parameter of `module` takes gradients (a frozen block's forward saves nothing for the backward)."""
    return any(p.requires_grad for p in module.parameters())


def compile_layers(model, backend="inductor", lengths: int | None = None, dynamic: bool = False) -> None:
    """Regional compilation: each decoder layer through torch.compile (one compiled graph reused by all layers).
    `dynamic`: one graph for every micro-batch length (varlen attention, whose kernel takes any length); else
    static shapes, one graph per static micro-batch length (`lengths` per token budget: --length_buckets)."""
    import torch._dynamo
    import torch._inductor.config

    from fastdpo.model.attention import allow_recompiles
    from fastdpo.model.backend import SHAPE_BUCKETS
    from fastdpo.model.load import base_causal_lm

    lengths = lengths or SHAPE_BUCKETS

    if torch._inductor.config.triton.cudagraphs:
        raise FastDPOError("CUDA graphs (TORCHINDUCTOR_CUDAGRAPHS=1) cannot replay the per-layer compiled graphs of "
                           "--torch_compile: one graph serves every layer, so each layer's replay overwrites the "
                           "output of the layer before, which the backward still needs. Unset TORCHINDUCTOR_CUDAGRAPHS.")
    # one graph per static micro-batch length, with and without grad, and a few for pairs longer than the budget:
    # keep them all
    allow_recompiles(max(32, 2 * lengths + 16))
    # under DDP, TorchDynamo would split each layer's graph again at the reduction buckets' boundaries (its "DDP
    # optimizer", meant for one whole-model graph); per-layer graphs already let the reductions overlap the
    # backward, and the extra splits only cost fusion and kernel launches
    torch._dynamo.config.optimize_ddp = False
    lm = base_causal_lm(model)
    if not lm.get_input_embeddings().weight.requires_grad:
        # frozen embeddings (LoRA): the first layer's input would not require grad and get a graph of its own
        lm.enable_input_require_grads()
    if dynamic:
        dynamic_shape_settings()
    for layer in decoder_layers(model):
        layer.compile(dynamic=dynamic, backend=backend)


def dynamic_shape_settings() -> None:
    """Settings under which a dynamic-shape layer graph stays one graph for every length: Inductor's mix-order
    reduction fusion guards on ranges of the length (four graphs for six lengths, each rebuilt in seconds), and
    duck shapes would tie the length to an equal dimension of the first batch (e.g. 128 = head_dim) and recompile
    at the next length. Neither changes what is computed."""
    import torch._inductor.config as inductor

    if hasattr(inductor, "triton") and hasattr(inductor.triton, "mix_order_reduction"):
        inductor.triton.mix_order_reduction = False
    try:
        import torch.fx.experimental._config as fx_config

        if hasattr(fx_config, "use_duck_shape"):
            fx_config.use_duck_shape = False
    except ImportError:  # pragma: no cover - older torch
        pass


class OffloadActivations(torch.autograd.graph.saved_tensors_hooks):
    """Context for the forward pass: activations saved for backward move to (pinned) CPU memory and come back when
    backward needs them. Parameters (and views of them), CPU tensors and small tensors stay where they are. The
    copies are queued on the compute stream, so they cost transfer time but no host synchronisation; pair it with
    `none` or `ffn` checkpointing (what a checkpointed region saves is recomputed, not offloaded)."""

    MIN_BYTES = 1 << 20

    def __init__(self, model: torch.nn.Module, min_bytes: int | None = None):
        params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        floor = self.MIN_BYTES if min_bytes is None else min_bytes
        self.offloaded_bytes = 0

        def pack(t: torch.Tensor):
            size = t.numel() * t.element_size()
            if size < floor or not t.is_contiguous() or t.untyped_storage().data_ptr() in params:
                return t
            host = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=t.is_cuda)
            host.copy_(t, non_blocking=True)
            self.offloaded_bytes += size
            return (t.device, host)

        def unpack(packed):
            if isinstance(packed, torch.Tensor):
                return packed
            device, host = packed
            return host.to(device, non_blocking=True)

        super().__init__(pack, unpack)


def offloading(enabled: bool, model: torch.nn.Module):
    """`OffloadActivations(model)` when enabled, else a no-op context."""
    import contextlib

    return OffloadActivations(model) if enabled else contextlib.nullcontext()


def activation_bytes(config, tokens: int, checkpointed: bool = False, dtype_bytes: int = 2) -> int:
    """A rough count of the activations a policy forward over `tokens` packed tokens keeps for its backward: per
    decoder layer and token, `dtype_bytes` x (6 hidden + 2 key/value widths + 4 intermediate): the inputs of the two
    norms, of the q/k/v and output projections, the attention output, and the SwiGLU MLP's gate, up, activation and
    product (FlashAttention keeps no score matrix). With --gradient_checkpointing full, each layer keeps its input
    and one layer at a time holds the rest. Under --sequence_parallel_size N each rank keeps about 1/N of it."""
    cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
    hidden, layers = cfg.hidden_size, cfg.num_hidden_layers
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or hidden // heads
    kv = getattr(cfg, "num_key_value_heads", None) or heads
    inter = getattr(cfg, "intermediate_size", None) or 4 * hidden
    per_layer = dtype_bytes * (4 * hidden + 2 * heads * head_dim + 2 * kv * head_dim + 4 * inter)
    if checkpointed:
        return tokens * (layers * dtype_bytes * hidden + per_layer)
    return tokens * layers * per_layer
