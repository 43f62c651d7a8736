"""`--gradient_checkpointing fit` (the default): the fastest of no checkpointing, FFN-only, full-but-the-last-N-layers
(`keep:N`) and full checkpointing whose estimated peak memory fits the limit, chosen before the first step without
timing anything. Between ffn and keep:N, the one that recomputes less (keep:N with the largest N that fits). The limit is
--max_memory_gib; by default it is what training holds anyway plus about the model's weights' size for activations
(at most 90 % of the GPU): a peak about that of other trainers' defaults, which checkpoint every layer, while
--max_memory_gib spends more memory on speed (none instead of full: 18–23 % faster on Qwen3-1.7B).

The estimate is measured, not guessed: one forward with grad of a short filler pair through the model as it will
train (its attention backend, LoRA, dtype) records what autograd keeps for the backward, per token, in three parts:
inside the MLPs, elsewhere inside the decoder layers, and outside them (embeddings, final norm, the log-prob head).
Each policy keeps a known share of those parts:

    none    everything
    ffn     everything but the MLPs' own tensors, plus each MLP's input
    full    each layer's input, what is outside the layers, and one layer's tensors while it is recomputed
    keep:N  as full for all but the last N layers, which keep everything

The peak is then the memory held now (weights, the reference), the gradients and AdamW's two moments of the
trainable weights, the log-prob head's float32 chunk, and the largest micro-batch's activations under the policy
with a 10 % margin for the allocator, plus 0.5 GiB. A vision-language model whose vision tower trains (--freeze_vit
false) keeps the tower's activations too, per patch, until the end of the backward: `measure_vision` measures them
per pixel-value element on a small probe image, whole and with the tower's blocks checkpointed (every policy but
none checkpoints them), and the largest micro-batch's images count beside its tokens.

When every step is one micro-batch on one process under a limit the user names, the gradients and the activations are
not counted as if they coexisted: the backward writes each layer's gradients as it frees that layer's activations, so
the estimate walks the layers from the last and takes the most held at once (`backward_peak`; with gradient
accumulation the next micro-batch runs beside all of them). The default limit keeps counting them together: it budgets
the activations themselves (see `ACTIVATION_SHARE`). The largest micro-batch is the largest the run will form: its
steps are known ahead for data in memory (the seeded order of each epoch, or the steps a caller names). On one rank
without a token budget that is exact; over ranks, or under a budget, a close bound (`planned_largest_micro_batch`).
For a stream, the largest any order could form. When not even full checkpointing fits the largest micro-batch of
--per_device_train_batch_size pairs, a token budget (--max_tokens_per_batch) is set that does (at least the longest
pair; a warning when even that is estimated not to fit). With `--kernels` Triton (the default on CUDA) the norms and
MLPs are already lean when this measures. Otherwise, when no checkpointing does not fit, the lean torch norms and MLPs
of `fastdpo.model.fused` (fewer bytes kept, some speed spent: 16.6 against 19.5 pairs/s on Qwen3-1.7B without
checkpointing) are switched on and the activations measured again before choosing."""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from fastdpo.data.pack import epoch_permutation, split_micro_batches
from fastdpo.data.tokenize import TokenizedPair
from fastdpo.kernels.logprob_head import DEFAULT_CHUNK
from fastdpo.model.backend import build_mask, make_batch
from fastdpo.model.fused import fuse_layers
from fastdpo.model.load import base_causal_lm
from fastdpo.model.memory import decoder_layers, trains, vision_blocks
from fastdpo.model.seqlogps import completion_logps
from fastdpo.model.vlm import vision_features, vision_ids
from fastdpo.parallel.split import split_ranks

log = logging.getLogger("fastdpo")

CANDIDATES = ("none", "ffn", "full")  # fastest first
PROBE_TOKENS = 512
MARGIN = 1.10  # on activations: the caching allocator's fragmentation and kernels' workspaces
HEADROOM_GIB = 0.5


@dataclass
class ActivationBytes:
    """Bytes autograd keeps per token of a micro-batch, by where they are kept."""

    mlp: float
    layer: float  # inside decoder layers, outside their MLPs
    outside: float
    layer_input: float  # one layer's input (hidden size x dtype), what full checkpointing keeps per layer
    layers: int
    vision_kept: float = 0.0  # a trained vision tower, per element of its pixel values: kept with its blocks whole
    vision_checkpointed: float = 0.0  # ... and with its blocks checkpointed (any policy but none)

    def vision(self, policy: str, pixels: int) -> float:
        """Bytes a trained vision tower keeps for a micro-batch of `pixels` pixel-value elements under `policy`."""
        return pixels * (self.vision_kept if policy == "none" else self.vision_checkpointed)

    def per_token(self, policy: str) -> float:
        """Bytes kept per token under `policy`: none, ffn, full or keep:N (full but the last N layers, which keep
        everything)."""
        one_layer = (self.mlp + self.layer) / max(self.layers, 1)
        if policy == "none":
            return self.mlp + self.layer + self.outside
        if policy == "ffn":
            return self.layer + self.outside + self.layers * self.layer_input
        if policy == "full":
            return self.outside + self.layers * self.layer_input + one_layer
        if policy.startswith("keep:"):
            kept = min(int(policy.split(":", 1)[1]), self.layers)
            recomputed = self.layers - kept
            return self.outside + recomputed * self.layer_input + kept * one_layer + (one_layer if recomputed else 0)
        raise ValueError(policy)

    def by_layer(self, policy: str) -> list[tuple[float, float]]:
        """Per token, for each decoder layer in order: what `policy` keeps of it from the forward to its backward,
        and what exists only while its backward runs (a recompute's tensors)."""
        n = max(self.layers, 1)
        one_layer = (self.mlp + self.layer) / n
        if policy == "none":
            return [(one_layer, 0.0)] * self.layers
        if policy == "ffn":
            return [(self.layer / n + self.layer_input, self.mlp / n)] * self.layers
        if policy == "full":
            return [(self.layer_input, one_layer)] * self.layers
        if policy.startswith("keep:"):
            kept = min(int(policy.split(":", 1)[1]), self.layers)
            return [(self.layer_input, one_layer)] * (self.layers - kept) + [(one_layer, 0.0)] * kept
        raise ValueError(policy)


@dataclass
class GradBytes:
    """Bytes of the trainable weights' gradients: outside the decoder layers (embeddings, the head, the final norm:
    written first, at the head, or held from there on) and of each decoder layer, in order. Two transients: the
    log-prob head sums its weight's gradient in float32 before rounding it (`head_accumulator`), and a tied
    embedding's gradient from the input side is formed whole before it is added (`tied_embedding`)."""

    outside: int
    layers: list[int]
    head_accumulator: int = 0
    tied_embedding: int = 0

    @property
    def total(self) -> int:
        return self.outside + sum(self.layers)


def grad_bytes(model) -> GradBytes:
    """The gradients' bytes of `model`'s trainable weights, by decoder layer (a tied weight counts once)."""
    per_layer = [sum(p.numel() * p.element_size() for p in layer.parameters() if p.requires_grad)
                 for layer in decoder_layers(model)]
    total = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    lm = base_causal_lm(model)
    head = getattr(lm.get_output_embeddings(), "weight", None) if hasattr(lm, "get_output_embeddings") else None
    embed = getattr(lm.get_input_embeddings(), "weight", None) if hasattr(lm, "get_input_embeddings") else None
    trained_head = isinstance(head, torch.Tensor) and head.requires_grad
    return GradBytes(total - sum(per_layer), per_layer,
                     head_accumulator=head.numel() * 4 if trained_head else 0,
                     tied_embedding=embed.numel() * embed.element_size() if trained_head and embed is head else 0)


def backward_peak(act: ActivationBytes, grads: GradBytes, policy: str, tokens: int, margin: float = MARGIN) -> float:
    """The most bytes of activations and gradients held at once by a step of one micro-batch of `tokens` tokens (the
    gradients start from none). The head's backward comes first, beside every kept activation: its float32 sum of
    the weight's gradient and the rounded gradient. Then the backward walks the layers from the last: at each it
    holds the gradients written so far, what the layers below it (and it) keep, its transient tensors, and a
    workspace of about one layer's activations (the gradients of its intermediate tensors); then it frees the
    layer's activations and writes its weights' gradients. Last, all the gradients, and a tied embedding's second
    one. Activations take `margin` for the allocator."""
    terms = act.by_layer(policy)
    workspace = (act.mlp + act.layer) / max(act.layers, 1)
    below = act.outside + sum(kept for kept, _ in terms)
    written = float(grads.outside)
    peak = written + grads.head_accumulator + margin * tokens * below
    for i in reversed(range(len(terms))):
        kept, transient = terms[i]
        peak = max(peak, written + margin * tokens * (below + transient + workspace))
        below -= kept
        written += grads.layers[i] if i < len(grads.layers) else 0
    return max(peak, float(grads.total + grads.tied_embedding))


def _storage_key(t: torch.Tensor):
    try:
        s = t.untyped_storage()
        return s.data_ptr(), s.nbytes()
    except (RuntimeError, NotImplementedError):  # a tensor subclass without one storage: count its own bytes
        return id(t), t.numel() * t.element_size()


def saved_by_region(model, device: torch.device, regions: list[tuple[torch.nn.Module, str]], forward,
                    entered=None) -> dict[str, int]:
    """Bytes autograd saves for the backward while `forward()` runs with grad and the model in training mode, by
    region: each module of `regions` (module, name) marks what is saved inside it with its name (the innermost
    wins), the rest is "outside". Weights (and views of them) are not counted; a storage saved twice counts once.
    The graph is dropped unused, and the random state restored (a dropout's draws stay training's). `entered(module,
    args, kwargs)`: also called as each region's module starts."""
    weights = {_storage_key(p)[0] for p in model.parameters()}
    region = ["outside"]
    seen: dict[int, tuple[str, int]] = {}

    def pack(t: torch.Tensor):
        key, nbytes = _storage_key(t)
        if key not in weights and key not in seen:
            seen[key] = (region[-1], nbytes)
        return t

    def enter(module, args, kwargs, name):
        region.append(name)
        if entered is not None:
            entered(module, args, kwargs)

    handles = []
    for module, name in regions:
        handles.append(module.register_forward_pre_hook(functools.partial(enter, name=name), with_kwargs=True))
        handles.append(module.register_forward_hook(lambda m, a, o: region.pop() and None))
    was_training = model.training
    model.train()
    cuda = device.type == "cuda"
    rng = torch.get_rng_state(), torch.cuda.get_rng_state(device) if cuda else None
    try:
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = forward()
            del out
    finally:
        for h in handles:
            h.remove()
        model.train(was_training)
        torch.set_rng_state(rng[0])
        if cuda:
            torch.cuda.set_rng_state(rng[1], device)
    total = {"outside": 0} | {name: 0 for _, name in regions}
    for where, nbytes in seen.values():
        total[where] += nbytes
    return total


def measure_activations(model, backend, pad_id: int, device: torch.device, tokens: int = PROBE_TOKENS) -> ActivationBytes:
    """One forward with grad of a filler pair of `tokens` tokens; what autograd saves, per token, by region
    (`saved_by_region`: inside the decoder layers' MLPs, elsewhere in the layers, outside them)."""
    lm = base_causal_lm(model)
    regions = [(m, name) for layer in decoder_layers(model)
               for m, name in ((layer, "layer"), (getattr(layer, "mlp", None), "mlp")) if m is not None]
    n = max(tokens, 4)
    pair = TokenizedPair(prompt=[5] * (n // 2), chosen=[6] * (n // 4), rejected=[7] * (n - n // 2 - n // 4), index=0)
    batch = make_batch([pair], backend, pad_id, device)
    total = saved_by_region(model, device, regions,
                            lambda: completion_logps(model, batch, backend, build_mask(batch, backend)))
    t = batch.num_tokens
    hidden = lm.config.get_text_config().hidden_size * next(lm.parameters()).element_size()
    return ActivationBytes(total.get("mlp", 0) / t, total.get("layer", 0) / t, total["outside"] / t, hidden,
                           len(decoder_layers(model)))


def measure_vision(model, pairs: list[TokenizedPair], device: torch.device) -> tuple[float, float]:
    """What a trained vision tower keeps for the backward, per element of its pixel values: (with its blocks whole,
    with them checkpointed). One forward with grad of the tower over one small image (`probe_image`): what its
    blocks save, and what it saves around them (the patch embedding, the mergers). Checkpointed, each block keeps
    its input, and one block's tensors exist again while it is recomputed. (0, 0) for a frozen tower or a text
    model."""
    blocks = [b for b in vision_blocks(model) if trains(b)]
    held = [p for p in pairs if p.num_images]
    if not blocks or not held:
        return 0.0, 0.0
    pixels, grid = probe_image(model, min(held, key=lambda p: p.pixel_values.numel()))
    inputs = []

    def block_input(module, args, kwargs):
        hidden = args[0] if args else kwargs.get("hidden_states")
        if isinstance(hidden, torch.Tensor) and not inputs:
            inputs.append(hidden.numel() * hidden.element_size())

    total = saved_by_region(model, device, [(b, "block") for b in blocks],
                            lambda: vision_features(model, pixels.to(device), None if grid is None else grid.to(device)),
                            block_input)
    n = pixels.numel()
    checkpointed = len(blocks) * (inputs[0] if inputs else 0) + total["block"] / len(blocks) + total["outside"]
    return (total["block"] + total["outside"]) / n, checkpointed / n


PROBE_PATCHES = 8  # the probe image of an M-RoPE tower: 8 x 8 patches (one attention window of Qwen2.5-VL's)


def probe_image(model, pair: TokenizedPair) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(pixel_values, image_grid_thw) of one image for `measure_vision`, small enough that keeping all of the tower's
    activations for it costs little next to a loaded model: for the M-RoPE families a grid of `PROBE_PATCHES`
    squared patches, in the pair's pixel layout (random values: the bytes kept do not depend on them); for the
    fixed-size families (LLaVA) the pair's first image."""
    if vision_ids(base_causal_lm(model).config).mrope and pair.image_grid_thw is not None:
        g = torch.Generator().manual_seed(0)
        n = PROBE_PATCHES
        pixels = torch.randn(n * n, pair.pixel_values.shape[-1], generator=g).to(pair.pixel_values.dtype)
        return pixels, torch.tensor([[1, n, n]], dtype=torch.long)
    return pair.pixel_values[:1], None


def largest_pixels(pairs: list[TokenizedPair], per_micro: int) -> int:
    """The most pixel-value elements a micro-batch of `per_micro` pairs can hold (the pairs with the most, together):
    a bound whatever the order."""
    sizes = sorted((p.pixel_values.numel() for p in pairs if p.num_images), reverse=True)
    return sum(sizes[:max(per_micro, 1)])


def largest_micro_batch(pairs: list[TokenizedPair], per_micro: int, budget: int) -> int:
    """Tokens of the largest micro-batch any order of `pairs` can form: under a budget, the budget (or the longest
    pair); without one, the `per_micro` longest pairs together. For runs whose steps are not known ahead (a stream)."""
    lengths = sorted((p.num_tokens for p in pairs), reverse=True)
    if not lengths:
        return 0
    if budget > 0:
        return max(budget, lengths[0])
    return sum(lengths[:per_micro])


def largest_planned_micro_batch(steps: Iterable[list[TokenizedPair]], per_micro: int, budget: int,
                                world: int = 1) -> int:
    """Tokens of the largest micro-batch that `steps` (each optimizer step's pairs, over all `world` data-parallel
    ranks) form, as training forms them: each step dealt to the ranks (`split_ranks`), each rank's share cut into
    micro-batches (`split_micro_batches`). Ranks that later split a micro-batch further to line up with the others
    only make it smaller, so this bounds every rank's; every rank computes the same number."""
    largest = 0
    for step in steps:
        if world == 1 and budget <= 0:  # consecutive groups: no need to build them
            largest = max([largest] + [sum(p.num_tokens for p in step[i:i + per_micro])
                                       for i in range(0, len(step), per_micro)])
            continue
        for share in split_ranks(step, world):
            for group in split_micro_batches(share, budget, per_micro):
                largest = max(largest, sum(p.num_tokens for p in group))
    return largest


def planned_largest_micro_batch(pairs: list[TokenizedPair], per_step: int, per_micro: int, budget: int, world: int,
                                seed: int, shuffle: bool, total_steps: int, steps_per_epoch: int,
                                runs: list[int] | None = None) -> int:
    """Tokens of the largest micro-batch of a run of `total_steps` steps of `per_step` pairs (over all `world` ranks)
    over `pairs` in memory, in the seeded order of each epoch that `Trainer.next_pairs` follows, computed on tensors
    (a second or less for millions of pairs). Exact for one rank without a budget (each step's consecutive groups of
    `per_micro` pairs); otherwise a bound that `largest_planned_micro_batch` never exceeds: the `per_micro` longest
    pairs of a step together (a rank's share is cut into groups of its pairs), or under a budget the budget, the
    largest step or the longest pair."""
    if not pairs or total_steps <= 0:
        return 0
    tokens = torch.tensor([p.num_tokens for p in pairs], dtype=torch.int64)
    width = -(-per_step // per_micro) * per_micro  # groups of per_micro pairs tile a step
    largest, epoch = 0, 0
    while epoch * steps_per_epoch < total_steps:
        n = min(steps_per_epoch, total_steps - epoch * steps_per_epoch)
        t = tokens[epoch_permutation(len(pairs), seed, epoch, shuffle, runs)[: n * per_step]]
        steps = torch.zeros(n * per_step, dtype=torch.int64)
        steps[: t.numel()] = t  # the last step of an epoch may be short
        steps = torch.nn.functional.pad(steps.view(n, per_step), (0, width - per_step))
        if budget > 0:
            m = max(min(budget, int(steps.sum(1).max())), int(steps.max()))
        elif world == 1:
            m = int(steps.view(n, -1, per_micro).sum(-1).max())
        else:
            m = int(steps.sort(dim=1, descending=True).values[:, :per_micro].sum(1).max())
        largest = max(largest, m)
        epoch += 1
    return largest


def static_bytes(model, device: torch.device) -> int:
    """Held through training: what is allocated now, plus the gradients and AdamW's two moments (kept in the
    weights' dtype) of the trainable weights."""
    trainable = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    return torch.cuda.memory_allocated(device) + 3 * trainable


def head_bytes(model) -> int:
    """The log-prob head's float32 logits chunk and its gradient."""
    return 2 * DEFAULT_CHUNK * base_causal_lm(model).get_output_embeddings().weight.shape[0] * 4  # rows: vocabulary


@dataclass
class Fit:
    policy: str
    budget: int  # the token budget to use (the given one, or one set so the run fits)
    estimates_gib: dict  # policy -> estimated peak GiB at the largest micro-batch


def ffn_recompute_share(model) -> float:
    """What an FFN-only recompute costs against a whole layer's, by the projections' weights of the first decoder
    layer: the gate and up projections against every projection but the down one (which neither recompute runs:
    `fastdpo.model.fused`). Attention's own work counts for nothing here, so the share errs high, against ffn."""
    layers = decoder_layers(model)
    if not layers:
        return 1.0
    sizes: dict[str, int] = {}
    for name, p in layers[0].named_parameters():
        if p.dim() == 2 and "lora_" not in name:
            sizes[name] = p.numel()
    mlp_in = sum(n for k, n in sizes.items() if "gate_proj" in k or "up_proj" in k)
    total = sum(n for k, n in sizes.items() if "down_proj" not in k)
    return mlp_in / total if mlp_in and total else 1.0


def choose_fit(act: ActivationBytes, static: int, head: int, limit: int, largest: int, budget: int,
               longest: int, ffn_share: float = 1.0, grads: GradBytes | None = None, pixels: int = 0) -> Fit:
    """The fastest candidate whose estimated peak fits `limit` bytes at the largest micro-batch; else full
    checkpointing under a token budget that fits (never below the longest pair, warned when even that is estimated
    not to fit). Between none and full: ffn, which recomputes every layer's MLP (`ffn_share` of a layer's recompute,
    `ffn_recompute_share`), and keep:N, which recomputes all layers but the last N, with the largest N that fits;
    the one that recomputes less. `grads`: every step is one micro-batch, so its gradients (counted in `static`) are
    written as the backward frees the activations (`backward_peak`); None: they coexist with the activations. A
    token budget set here splits steps into several micro-batches, so it is sized with them coexisting. `pixels`:
    the pixel-value elements of the largest micro-batch's images, whose trained vision tower keeps its activations
    until the end of the backward (its own backward comes last), beside everything else."""

    def peak(policy: str, tokens: int) -> float:
        vision = act.vision(policy, pixels) * MARGIN
        if grads is not None:
            return (static - grads.total + head + backward_peak(act, grads, policy, tokens) + vision
                    + HEADROOM_GIB * 2**30)
        return static + head + act.per_token(policy) * tokens * MARGIN + vision + HEADROOM_GIB * 2**30

    kept = max((n for n in range(1, act.layers) if peak(f"keep:{n}", largest) <= limit), default=0)
    estimates = {p: round(peak(p, largest) / 2**30, 1) for p in CANDIDATES}
    if kept:
        estimates[f"keep:{kept}"] = round(peak(f"keep:{kept}", largest) / 2**30, 1)
    if peak("none", largest) <= limit:
        return Fit("none", budget, estimates)
    ffn = peak("ffn", largest) <= limit
    if kept and (not ffn or act.layers - kept < act.layers * ffn_share):
        return Fit(f"keep:{kept}", budget, estimates)
    if ffn:
        return Fit("ffn", budget, estimates)
    if peak("full", largest) <= limit:
        return Fit("full", budget, estimates)
    room = (limit - HEADROOM_GIB * 2**30 - static - head) / MARGIN - act.vision("full", pixels)
    fits = int(room // act.per_token("full")) // 256 * 256 if room > 0 else 0
    if fits < longest:  # the estimate errs high: try with the least activation memory, and let a real OOM speak
        log.warning("Memory: the longest pair (%d tokens) is estimated to need about %.1f GiB with full checkpointing, "
                    "and %.1f GiB are available; training with full checkpointing, one pair per micro-batch at worst. "
                    "If it runs out of memory: --train_type lora (or qlora), a lower --max_length, "
                    "--precompute_ref_log_probs, or several GPUs (--deepspeed zero3, --sequence_parallel_size).",
                    longest, peak("full", longest) / 2**30, limit / 2**30)
        return Fit("full", -(-longest // 256) * 256, estimates)
    return Fit("full", fits if budget <= 0 else min(budget, fits), estimates)


ACTIVATION_SHARE = 1.0  # the default limit: activations may take about as many bytes as the model's weights


def fit_checkpointing(cfg, plan, model, backend, pairs: list[TokenizedPair], device: torch.device, pad_id: int,
                      limit_gib: float | None, shards: int = 1, sequence_split: int = 1,
                      steps: Iterable[list[TokenizedPair]] | int | None = None, world: int = 1) -> None:
    """Resolve `--gradient_checkpointing fit` of `cfg` into the run's `plan` (and its token budget when one is needed);
    off CUDA memory is not the constraint: no checkpointing. `shards`: FSDP2's ranks, over which weights, gradients
    and moments are divided; `sequence_split`: the sequence-parallel group, over which a micro-batch's tokens are.
    `limit_gib` None: the default limit, at most 90 % of the GPU, under which the activations take about the model's
    weights' size (`ACTIVATION_SHARE`): a peak like that of other trainers' defaults, which checkpoint every layer;
    --max_memory_gib spends more memory on speed. `steps`: the pairs of each optimizer step the run will take, over
    its `world` data-parallel ranks (the largest micro-batch they form is what must fit), or that micro-batch's
    tokens when already planned (`planned_largest_micro_batch`); None when not known ahead (a stream), then the
    largest any order could form."""
    if device.type != "cuda" or not pairs:
        plan.gradient_checkpointing = "none"
        return
    gpu = int(torch.cuda.get_device_properties(device).total_memory * 0.9)
    limit = int(limit_gib * 2**30) if limit_gib else gpu
    resolve_fit(cfg, plan, model, backend, pairs, device, pad_id, limit, static_bytes(model, device), shards,
                sequence_split, default_limit=not limit_gib, steps=steps, world=world)


def weight_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def resolve_fit(cfg, plan, model, backend, pairs: list[TokenizedPair], device: torch.device, pad_id: int, limit: int,
                static: int, shards: int = 1, sequence_split: int = 1, default_limit: bool = False,
                steps: Iterable[list[TokenizedPair]] | int | None = None, world: int = 1) -> None:
    """`fit_checkpointing` given the memory `limit` and the `static` bytes of one unsharded process, in bytes
    (`default_limit`: `limit` is the GPU's, and the default share for activations lowers it)."""
    budget = plan.max_tokens_per_batch
    split = max(sequence_split, 1)
    per_micro = cfg.per_device_train_batch_size
    if steps is None:
        planned = largest_micro_batch(pairs, per_micro, budget)
    elif isinstance(steps, int):
        planned = steps
    else:
        planned = largest_planned_micro_batch(steps, per_micro, budget, world)
    largest = -(-planned // split)
    longest = -(-max(p.num_tokens for p in pairs) // split)
    static, head = static // max(shards, 1), head_bytes(model)
    if default_limit:
        share = ACTIVATION_SHARE * weight_bytes(model) // max(shards, 1)
        limit = min(limit, int(static + head + share + HEADROOM_GIB * 2**30))
    rank_budget = -(-budget // split) if budget > 0 else 0  # tokens of a micro-batch that one rank holds
    ffn_share = ffn_recompute_share(model)
    # one micro-batch per step on one process, under a limit the user named: the gradients do not coexist with the
    # activations (the default limit budgets the activations as if they did; DDP's buckets and FSDP2's shards hold
    # gradients throughout, and accumulation or a token budget runs later micro-batches beside them)
    one_micro = (not default_limit and world <= 1 and shards <= 1 and split == 1 and budget <= 0
                 and cfg.gradient_accumulation_steps == 1)
    grads = grad_bytes(model) if one_micro else None
    vision = measure_vision(model, pairs, device)
    pixels = largest_pixels(pairs, per_micro)

    def measured() -> ActivationBytes:
        act = measure_activations(model, backend, pad_id, device)
        act.vision_kept, act.vision_checkpointed = vision
        return act

    fit = choose_fit(measured(), static, head, limit, largest, rank_budget, longest, ffn_share, grads, pixels)
    lean = fit.policy != "none"
    # memory is short: the lean norms and MLPs keep fewer bytes (and cost some speed), so measure again, unless the
    # layers were lean already (the Triton kernels) and the first measurement stands
    if lean and fuse_layers(model):
        fit = choose_fit(measured(), static, head, limit, largest, rank_budget, longest, ffn_share, grads, pixels)
    fit.budget = budget if fit.budget == rank_budget else fit.budget * split  # a rank's tokens -> the micro-batch's
    plan.gradient_checkpointing = fit.policy
    shown = ", ".join(f"{p} ~{g} GiB" for p, g in fit.estimates_gib.items())
    if fit.budget != budget:
        plan.max_tokens_per_batch = fit.budget
        log.info("Memory: micro-batches of %d tokens would not fit in %.1f GiB even with full checkpointing (%s): "
                 "training with --gradient_checkpointing full --max_tokens_per_batch %d.", largest, limit / 2**30,
                 shown, fit.budget)
    else:
        log.info("Memory: --gradient_checkpointing %s%s, the fastest that fits %.1f GiB%s at the largest micro-batch "
                 "(%d tokens%s; estimated peaks: %s). Name a policy to choose another.", fit.policy,
                 " with lean norms and MLPs" if lean else "", limit / 2**30,
                 " (by default activations take about the weights' size; --max_memory_gib spends more on speed)"
                 if default_limit else "", largest,
                 f", and {pixels:,} pixel values through the trained vision tower" if vision[0] else "", shown)
