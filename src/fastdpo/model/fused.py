"""Lean RMSNorm and SwiGLU for training (the same forward, fewer bytes kept for the backward), and rotary embeddings
as one kernel: the modules' forwards that call the ops of `fastdpo.kernels`.

transformers' RMSNorm casts its input to float32 and autograd keeps that copy, and the normalised bfloat16 result
too: six bytes per element beyond the input, for every norm (two per layer, plus Qwen3's per-head query and key
norms). Its SwiGLU MLP keeps the gate, the up projection, the activated gate and their product. Here the norm keeps
only its input and one float32 inverse RMS per row (`fastdpo.kernels.rms_norm`), and the MLP keeps the gate and up
projections, recomputing the activation and the product in the backward (`fastdpo.kernels.swiglu`: a few
elementwise kernels, against 30-45 % of a layer's activation bytes on the Qwen3 shapes).

The forward runs the modules' own operations in their order, so its results are bit-identical; `fuse_layers`
checks that on a probe input for each module class before replacing its forward, and leaves a class whose forward
differs (e.g. Gemma's `1 + weight` norm) as it is. The backward is the analytic gradient, in float32 where the
original computes in float32.

With `use_kernels` the same formulas run as the Triton kernels of `fastdpo.kernels` on CUDA: one pass each
way instead of eager's five to ten, in the policy's training forward and backward and in the reference's no-grad
forward alike (so both compute the same numbers). Their forward equals the eager one to the dtype's rounding, not
bit for bit (a sum's order differs); their tests hold forward and gradients to the float32 computation. Rotary
embeddings then run as one kernel too: the modeling module's `apply_rotary_pos_emb` (shared by every model of its
class) is routed through a dispatcher that uses the kernel only inside a fused attention's forward."""

from __future__ import annotations

import contextlib
import contextvars
import functools
import logging
import sys
import types

import torch

from fastdpo.errors import FastDPOError
from fastdpo.kernels import launch, rms_norm, rope, swiglu
from fastdpo.kernels.fp8 import keep_quantised
from fastdpo.model import lora
from fastdpo.model.fp8 import PRE_NORM_LAYERS, is_fp8_linear, is_fp8_trained
from fastdpo.model.load import base_causal_lm
from fastdpo.model.memory import recomputing

log = logging.getLogger("fastdpo")


def _fast(module, x: torch.Tensor, weight: torch.Tensor | None = None) -> bool:
    """Whether the Triton kernels serve this call: asked for, on their device, in the weights' dtype, and not
    inside a torch.compile trace (Inductor fuses the torch path there)."""
    return (module._fastdpo_kernels and launch.available(x) and (weight is None or weight.dtype == x.dtype)
            and not torch.compiler.is_compiling())


def _fp8_readers(module) -> int:
    """How many FP8 products with row-wise scales read this norm's (MLP product's) output (`--fp8` marks them:
    `fastdpo.model.fp8.convert_to_fp8_training`); 0: none, its kernel writes no e4m3 copy."""
    out = module.__dict__.get("_fastdpo_fp8_out")
    return out[1] if out is not None and out[0] == "rowwise" else 0


def _norm_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    grad = torch.is_grad_enabled() and (hidden_states.requires_grad or self.weight.requires_grad)
    if _fast(self, hidden_states, self.weight):
        quantise = _fp8_readers(self)  # read by FP8 products (--fp8)
        if grad:
            return rms_norm.RMSNormFunction.apply(hidden_states, self.weight, self.variance_epsilon, True, quantise)
        if quantise:
            y, _, kept = rms_norm.rms_norm_forward_fp8(hidden_states, self.weight, self.variance_epsilon)
            keep_quantised(y, "rowwise", *kept, quantise)
            return y
        return rms_norm.rms_norm_forward(hidden_states, self.weight, self.variance_epsilon)[0]
    if grad and self.training:
        return rms_norm.RMSNormFunction.apply(hidden_states, self.weight, self.variance_epsilon, False)
    return self._fastdpo_plain_forward(hidden_states)


def _plain_linear(m) -> bool:
    return (type(m) is torch.nn.Linear and m.bias is None and not is_fp8_linear(m)  # FP8 layers run their own forward
            and not is_fp8_trained(m))


def _mlp_forward(self, x: torch.Tensor) -> torch.Tensor:
    grad = torch.is_grad_enabled()
    fast = _fast(self, x, self.down_proj.weight if _plain_linear(self.down_proj) else None)
    if not fast and not (grad and self.training):
        return self._fastdpo_plain_forward(x)
    gate, up = self.gate_proj(x), self.up_proj(x)
    quantise = _fp8_readers(self) if fast else 0  # an FP8 down projection (--fp8)
    if not grad:  # the reference's forward: the kernel alone
        if quantise:
            p, kept = swiglu.silu_mul_fp8(gate, up)
            keep_quantised(p, "rowwise", *kept, quantise)
            return self.down_proj(p)
        return self.down_proj(swiglu.silu_mul(gate, up))
    # a checkpoint's recompute of an output that only joins the residual stream, which keeps nothing of it: the
    # down projection need not run
    skip = getattr(self, "_fastdpo_residual", False) and not torch.compiler.is_compiling() and recomputing()
    if _plain_linear(self.down_proj):  # checked per call: LoRA may wrap it after the layers were fused
        return swiglu.SiluMulDownFunction.apply(gate, up, self.down_proj.weight, fast, skip)
    out = lora.silu_mul_down(self.down_proj, gate, up, fast, skip)  # a served LoRA: the product is not kept
    return out if out is not None else self.down_proj(swiglu.SiluMulFunction.apply(gate, up, fast, quantise))


_ROPE_KERNELS = contextvars.ContextVar("fastdpo_rope_kernels", default=False)  # set inside a fused attention


def _rope_serves(q, k, cos, sin) -> bool:
    return (not torch.compiler.is_compiling() and _ROPE_KERNELS.get() and q.dim() == 4 and k.dim() == 4
            and cos.dim() == 3 and cos.shape == sin.shape
            and q.shape[-1] == k.shape[-1] == cos.shape[-1] and q.shape[-1] % 2 == 0
            and q.shape[2] == k.shape[2] == cos.shape[1] and q.shape[0] == k.shape[0] and cos.shape[0] in (1, q.shape[0])
            and q.dtype == k.dtype == cos.dtype == sin.dtype and not (cos.requires_grad or sin.requires_grad)
            and launch.available(q) and q.device == cos.device)


def _rope_dispatch(plain):
    """The modeling module's `apply_rotary_pos_emb`, run as the kernel inside a fused attention's forward (policy
    and reference alike) and as itself everywhere else (other models in the process, other call shapes)."""

    @functools.wraps(plain)
    def apply_rotary_pos_emb(q, k, cos, sin, *args, **kwargs):
        if args or kwargs or not _rope_serves(q, k, cos, sin):
            return plain(q, k, cos, sin, *args, **kwargs)
        if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad):
            return rope.RopeFunction.apply(q, k, cos, sin)
        return rope.rope(q, cos, sin), rope.rope(k, cos, sin)

    apply_rotary_pos_emb._fastdpo_plain = plain
    return apply_rotary_pos_emb


def _rope_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


@functools.cache
def _rope_module(name: str) -> bool:
    """Route the modeling module `name`'s `apply_rotary_pos_emb` through `_rope_dispatch`, if it computes the standard
    rotation (checked on a float32 probe: partial or interleaved rotations keep their own)."""
    mod = sys.modules.get(name)
    plain = getattr(mod, "apply_rotary_pos_emb", None)
    if plain is None or not callable(plain):
        return False
    if hasattr(plain, "_fastdpo_plain"):
        return True
    g = torch.Generator(device="cpu").manual_seed(0)
    q, k = torch.randn(1, 2, 3, 8, generator=g), torch.randn(1, 1, 3, 8, generator=g)
    angles = torch.randn(1, 3, 4, generator=g).repeat(1, 1, 2)
    cos, sin = angles.cos(), angles.sin()
    try:
        got = plain(q, k, cos, sin)
    except Exception:  # noqa: BLE001 - another signature: not the standard rotation
        return False
    c, s_ = cos[:, None], sin[:, None]
    if not (isinstance(got, tuple) and len(got) == 2 and all(isinstance(t, torch.Tensor) for t in got)
            and torch.equal(got[0], _rope_reference(q, c, s_)) and torch.equal(got[1], _rope_reference(k, c, s_))):
        log.info("%s keeps its own rotary embedding (it is not the standard rotation).", name)
        return False
    mod.apply_rotary_pos_emb = _rope_dispatch(plain)
    return True


def _attention_forward(self, *args, **kwargs):
    if not self._fastdpo_kernels or torch.compiler.is_compiling():  # compiled: Inductor fuses the rotation itself
        return self._fastdpo_plain_forward(*args, **kwargs)
    token = _ROPE_KERNELS.set(True)
    try:
        return self._fastdpo_plain_forward(*args, **kwargs)
    finally:
        _ROPE_KERNELS.reset(token)


def _is_rope_attention(m) -> bool:
    return (type(m).__name__.endswith("Attention") and hasattr(m, "q_proj") and hasattr(m, "k_proj")
            and _rope_module(type(m).__module__))


# decoder layers whose MLP output goes straight into the residual sum, where no later operation keeps it for the
# backward: the plain pre-norm layers
_RESIDUAL_MLP_LAYERS = PRE_NORM_LAYERS


def _is_norm(m) -> bool:
    return (type(m).__name__.endswith("RMSNorm") and isinstance(getattr(m, "weight", None), torch.Tensor)
            and m.weight.dim() == 1 and hasattr(m, "variance_epsilon"))


def _is_swiglu(m) -> bool:
    act = getattr(getattr(m, "config", None), "hidden_act", None)
    return (act == "silu" and all(hasattr(m, n) for n in ("gate_proj", "up_proj", "down_proj"))
            and isinstance(getattr(m, "act_fn", None), torch.nn.Module))


def _compute_dtype(model: torch.nn.Module) -> torch.dtype | None:
    """The dtype the model's activations take: its input embeddings' (an FP8 base's weights are not it)."""
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    weight = getattr(emb, "weight", None)
    return weight.dtype if isinstance(weight, torch.Tensor) else None


@torch.no_grad()
def _same_forward(module, width: int, dtype: torch.dtype | None = None) -> bool:
    """The lean torch forward equals the module's own, bit for bit, on a probe input (grad on, training) in the
    activations' `dtype` (default: the module's first parameter's): the module computes the standard formula,
    which the kernels compute too (their tests hold them to it)."""
    p = next(module.parameters())
    g = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(3, width, generator=g).to(device=p.device, dtype=dtype or p.dtype).requires_grad_()
    was, kernels_on = module.training, module._fastdpo_kernels
    module.train()
    module._fastdpo_kernels = False
    try:
        with torch.enable_grad():
            want = module._fastdpo_plain_forward(x)
            got = module.forward(x)
    finally:
        module.train(was)
        module._fastdpo_kernels = kernels_on
    return want.dtype == got.dtype and torch.equal(want, got)


def kernels_wanted(choice: str, device: torch.device, compiling: bool) -> bool:
    """Resolve --kernels: auto is Triton on CUDA when it is installed and the layers are not compiled."""
    if choice == "torch":
        return False
    usable = device.type == "cuda" and launch.HAVE_TRITON
    if choice == "triton" and not usable:
        raise FastDPOError("--kernels triton needs a CUDA GPU and Triton (installed with torch's CUDA wheels). "
                           "Use --kernels auto or torch.")
    return usable and (choice == "triton" or not compiling)


def fuse_layers(model: torch.nn.Module, use_kernels: bool = False) -> list[str]:
    """Give every RMSNorm and SwiGLU MLP of `model` the lean forward where it reproduces the module's own (checked
    once per class); returns the class names replaced. `use_kernels`: run them, the rotary embeddings and the
    log-prob head with the Triton kernels where those serve (CUDA), in training and in no-grad forwards (the
    reference's) alike. Idempotent; a second call can switch
    the kernels on. The forwards are bound methods, so a deep copy (the reference) is fused the same way."""
    _hub_kernels_off(model)
    done: dict[type, bool] = {}
    dtype = _compute_dtype(model)  # not an FP8 base's weight dtype
    residual = {id(layer.mlp) for layer in model.modules()
                if type(layer).__name__ in _RESIDUAL_MLP_LAYERS and isinstance(getattr(layer, "mlp", None), torch.nn.Module)}
    for m in model.modules():
        kind = "norm" if _is_norm(m) else "mlp" if _is_swiglu(m) else "attention" if _is_rope_attention(m) else None
        if kind is None:
            continue
        if hasattr(m, "_fastdpo_plain_forward"):
            m._fastdpo_kernels = m._fastdpo_kernels or use_kernels
            if "forward" not in m.__dict__:  # rebound by someone else since: bind ours again
                m.forward = types.MethodType(_FORWARDS[kind], m)
            continue
        m._fastdpo_plain_forward = m.forward
        m._fastdpo_kernels = use_kernels
        if kind == "mlp":
            m._fastdpo_residual = id(m) in residual
        m.forward = types.MethodType(_FORWARDS[kind], m)
        if kind == "attention":  # the forward is the module's own; only its rotation may run as the kernel
            done[type(m)] = True
            continue
        if type(m) not in done:
            width = m.weight.shape[0] if kind == "norm" else m.gate_proj.in_features
            done[type(m)] = _same_forward(m, width, dtype)
        if not done[type(m)]:
            del m.forward, m._fastdpo_plain_forward, m._fastdpo_kernels
            m.__dict__.pop("_fastdpo_residual", None)
    if use_kernels and isinstance(head := _output_layer(model), torch.nn.Module):
        head._fastdpo_kernels = True  # the log-prob head's kernels (`fastdpo.kernels.logprob_head`; they check each call)
    if kept := sorted(t.__name__ for t, ok in done.items() if not ok):
        _say_once(f"{', '.join(kept)} keep their own forward: on a probe input the lean forward (and the Triton "
                  "kernels) did not reproduce it bit for bit, so they run on torch's path. A transformers release "
                  "that changes these modules does this; training is correct, only slower and larger.")
    return sorted(t.__name__ for t, ok in done.items() if ok)


@contextlib.contextmanager
def eager_layers(model: torch.nn.Module):
    """The decoder's norms, MLPs and rotations on torch's eager ops while inside (the modules' own computation: the
    plain path the run's certificate compares the fast one with; no Triton kernel is built for its shapes). The
    log-prob head keeps its kernels."""
    fused = [m for m in model.modules() if hasattr(m, "_fastdpo_plain_forward") and hasattr(m, "_fastdpo_kernels")]
    was = [m._fastdpo_kernels for m in fused]
    for m in fused:
        m._fastdpo_kernels = False
    try:
        yield
    finally:
        for m, on in zip(fused, was):
            m._fastdpo_kernels = on


_FORWARDS = {"norm": _norm_forward, "mlp": _mlp_forward, "attention": _attention_forward}
_SAID: set[str] = set()


def _say_once(message: str) -> None:
    if message not in _SAID:
        _SAID.add(message)
        log.warning(message)


def _hub_kernels_off(model: torch.nn.Module) -> None:
    """Turn off transformers' hub kernelization (on by default in transformers 5 when the `kernels` package is
    installed): it fetches layer code from the hub and rebinds each decorated module's forward on every `.train()`,
    which would silently undo the lean forwards bound here."""
    for m in model.modules():
        if isinstance(getattr(type(m), "use_kernels", None), property) and getattr(m, "use_kernels", False):
            m.use_kernels = False
            _say_once("transformers' hub kernels are off for this model: fastdpo's own lean layers and kernels "
                      "replace them.")


def unfused(model: torch.nn.Module) -> list[str]:
    """Class names of the modules `fuse_layers` gave a lean forward that is no longer bound (something rebound
    the module's forward since): empty when every fused module still runs fastdpo's forward."""
    return sorted({type(m).__name__ for m in model.modules()
                   if hasattr(m, "_fastdpo_plain_forward") and "forward" not in m.__dict__})


def _output_layer(model: torch.nn.Module):
    """The output layer `backend.output_head` reads: the causal LM's (under a PEFT wrapper too), None without one."""
    get = getattr(base_causal_lm(model), "get_output_embeddings", None)
    return get() if callable(get) else None
