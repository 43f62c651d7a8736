"""The packed layout's forward: which attention backend runs (varlen, flex, dense, padded) and why, the micro-batch
in the backend's layout and its mask or offsets (built once, shared by all layers), and the decoder forward to the
hidden states that predict the completion tokens and their log-probs (DESIGN §1, §3, §4)."""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import torch

from fastdpo.data.pack import PairBatch, pack_pairs, packed_tokens, pad_pairs, split_micro_batches
from fastdpo.errors import FastDPOError
from fastdpo.kernels.logprob_head import token_logps
from fastdpo.model import attention
from fastdpo.model.attention import sliding_window
from fastdpo.model.load import base_causal_lm, decoder, is_vision_config
from fastdpo.model.logprobs import output_head, sequence_sums
from fastdpo.model.vlm import (
    VisionIds,
    language_attention,
    packed_vision_hidden,
    padded_vision_hidden,
    vision_batch,
    vision_ids,
)

log = logging.getLogger("fastdpo")

# Families whose attention is fully described by the pair rule (+ an optional uniform sliding window).
FLEX_PAD = 128  # flex rows are padded to a multiple of its block size


SHAPE_BUCKETS = 16  # default --length_buckets: a flex micro-batch is padded to the next 1/16 of the token budget


PACKED_FAMILIES = {"llama", "qwen2", "qwen3", "mistral", "gemma", "phi3", "granite", "olmo2", "qwen3_moe"}


@dataclass
class Backend:
    name: str  # varlen | flex | dense | padded
    window: int | None = None
    lengths: int = SHAPE_BUCKETS  # flex: static micro-batch lengths per token budget (`flex_length`)
    group: bool = False  # packed layouts: the pairs of one prompt as one group (`fastdpo.data.pack`)
    dedupe: bool = True  # in a group, a completion several pairs share is computed once
    vision: VisionIds | None = None  # a vision-language model: its image token id (and merge size), `fastdpo.model.vlm`

    def grouping(self, group: bool, dedupe: bool = True) -> Backend:
        """This backend laying out micro-batches in prompt groups (`group`; never on the padded path, which is the
        plain reference computation; a vision-language model's groups also hold the same images,
        `fastdpo.data.pack.prompt_groups`)."""
        return dataclasses.replace(self, group=group and self.name != "padded", dedupe=dedupe)

    def plain(self) -> Backend:
        """The padded path for the same model: the plain computation this backend is held to (a vision-language
        model's keeps its images)."""
        return Backend("padded", vision=self.vision)

    def micro_batches(self, pairs: list, max_tokens: int, pairs_per_micro: int) -> list[list]:
        """One step's pairs cut into micro-batches (`split_micro_batches`), counting tokens as this layout packs them."""
        return split_micro_batches(pairs, max_tokens, pairs_per_micro, self.group, self.dedupe)


# Names users bring from ms-swift / transformers scripts, and why the packed backend serves them instead.
_VARLEN = ("fastdpo's varlen backend runs FlashAttention's variable-length kernel with separate query and key offsets, "
           "so rejected tokens see the prompt but not chosen, with the prompt computed once.")


FOREIGN_ATTN = {"flash_attn": _VARLEN, "flash_attention_2": _VARLEN,
                "sdpa": "The packed layout needs its own mask; SDPA is what the dense and padded paths use.",
                "eager": "The packed layout needs its own mask; the padded path uses the model's own attention."}


def choose_backend(model, attn_impl: str, padding_free: bool, device: torch.device,
                   lengths: int = SHAPE_BUCKETS) -> Backend:
    """Pick the attention backend; fall back to `padded` with a logged reason where the packed rule would differ. A
    vision-language model (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, LLaVA) takes the same backends for its language model
    (`fastdpo.model.vlm`), its padded rows through the model's own multimodal forward."""
    cfg = base_causal_lm(model).config
    vision = vision_ids(cfg) if is_vision_config(cfg) else None
    if attn_impl in FOREIGN_ATTN:
        log.info("--attn_impl %s: using the %s backend. %s", attn_impl, "flex" if device.type == "cuda" else "dense",
                 FOREIGN_ATTN[attn_impl])
        attn_impl = "auto"
    if not padding_free or attn_impl == "padded":
        return Backend("padded", vision=vision)
    if vision is None:
        ok, window, reason = sliding_window(cfg)
        if cfg.model_type not in PACKED_FAMILIES:
            ok, reason = False, f"model_type {cfg.model_type!r} is not yet verified on the packed layout"
    else:  # its language model's window: the positions of a packed row with images take none
        ok, window, reason = sliding_window(decoder(model).config)
        if window is not None:
            ok, reason = False, "the language model's sliding window"
    if not ok:
        log.warning("Using the padded path: %s.", reason)
        return Backend("padded", vision=vision)
    name = attn_impl if attn_impl != "auto" else auto_backend(model, device)
    if name in ("flex", "varlen") and device.type != "cuda":
        raise FastDPOError(f"--attn_impl {name} needs a CUDA device. Use --attn_impl dense (or auto) on CPU.")
    if name == "varlen":
        why = varlen_unsupported(model)
        if why:
            raise FastDPOError(f"--attn_impl varlen: {why}. Use --attn_impl flex (or auto).")
    if vision is not None and name == "dense" and device.type == "cuda":
        log.warning("Vision-language model on the dense pair mask: its memory grows with the square of a "
                    "micro-batch's tokens; keep micro-batches small (--max_tokens_per_batch), or use --attn_impl auto.")
    return Backend(name, window, lengths, vision=vision)


def varlen_unsupported(model) -> str:
    """Why the varlen kernel cannot run this model ("" when it can)."""
    if not attention.varlen_available():
        return "this torch has no torch.nn.attention.varlen (torch 2.10 or later has it)"
    dtype = base_causal_lm(model).dtype
    if dtype not in (torch.bfloat16, torch.float16):
        return f"FlashAttention's kernel runs in bfloat16 or float16, and the model is in {str(dtype).split('.')[-1]}"
    return ""


def auto_backend(model, device: torch.device) -> str:
    """varlen on CUDA where it can run (no kernel is built per micro-batch length; with --torch_compile, one
    dynamic-shape graph serves every length), else flex; dense on CPU."""
    if device.type != "cuda":
        return "dense"
    why = varlen_unsupported(model)
    if why:
        log.info("Attention: FlexAttention (its kernels are built per micro-batch length), because %s.", why)
        return "flex"
    return "varlen"


def _set_attn(model, name: str) -> None:
    """Switch every sub-config to attention implementation `name` (transformers reads it at each forward)."""
    lm = base_causal_lm(model)
    if getattr(lm, "_fastdpo_attn", None) == name:
        return
    lm._fastdpo_attn = name
    attention.switch_attention(lm, name)


def prepare_packed(model, backend: Backend) -> None:
    attention.register()
    for module in base_causal_lm(model).modules():
        module._fastdpo_window = backend.window


def flex_length(tokens: int, budget: int, lengths: int = SHAPE_BUCKETS) -> int:
    """Padded length of a flex micro-batch holding `tokens`: the next multiple of budget / `lengths` (rounded up to
    the flex block), so a budget gives `lengths` static lengths and compiled kernels are built a few times, not per
    batch; a step's last, partly filled micro-batch is not padded to the whole budget; and a pair longer than the
    budget takes a few more lengths, not one per pair. More lengths pad less and build more kernels. Without a
    budget: the next multiple of the flex block."""
    if budget <= 0:
        return -(-tokens // FLEX_PAD) * FLEX_PAD
    step = -(-budget // (lengths * FLEX_PAD)) * FLEX_PAD
    return -(-tokens // step) * step


def flex_budget(pairs: list, pairs_per_micro: int) -> int:
    """A token budget for a run that gave none: about `pairs_per_micro` pairs (TokenizedPair) of average length,
    rounded up to 1024 tokens and never below the longest pair (so no pair needs a length of its own). Flex
    micro-batches then take a few static lengths (`flex_length`) instead of one per batch."""
    mean = sum(p.num_tokens for p in pairs) / len(pairs)
    want = max(pairs_per_micro * mean, max(p.num_tokens for p in pairs))
    return int(-(-want // 1024) * 1024)


def micro_batch_budget(backend: Backend, budget: int, pairs: list, pairs_per_micro: int) -> int:
    """The token budget micro-batches are cut under: `budget` when one is given. FlexAttention builds its kernels per
    micro-batch length, so without one it gets `flex_budget` (a few static lengths, not one per batch); the other
    backends keep 0 (micro-batches of `pairs_per_micro` pairs)."""
    if budget or backend.name != "flex" or not pairs:
        return budget
    return flex_budget(pairs, pairs_per_micro)


def make_batch(pairs: list, backend: Backend, pad_id: int, device: torch.device, budget: int = 0,
               prompt_targets: bool = False) -> PairBatch:
    """A micro-batch of TokenizedPairs in the backend's layout (packed, or padded rows), on `device`. Flex batches are
    padded to one of a few static lengths (`flex_length`). `prompt_targets`: with the prompt tokens' targets (a loss
    whose NLL covers the prompt, `losses.needs_prompt_targets`). A vision-language model's batches carry the pairs'
    images (`fastdpo.model.vlm.vision_batch`)."""
    if backend.vision is not None:
        multiple = 1 if backend.name != "flex" else \
            flex_length(packed_tokens(pairs, backend.group, backend.dedupe), budget, backend.lengths)
        batch = vision_batch(pairs, backend.vision, pad_id, prompt_targets, backend.name == "padded", multiple,
                             backend.group, backend.dedupe)
    elif backend.name == "padded":
        batch = pad_pairs(pairs, pad_id, prompt_targets)
    elif backend.name == "flex":
        tokens = packed_tokens(pairs, backend.group, backend.dedupe)
        batch = pack_pairs(pairs, flex_length(tokens, budget, backend.lengths), pad_id, prompt_targets, backend.group,
                           backend.dedupe)
    else:
        batch = pack_pairs(pairs, 1, pad_id, prompt_targets, backend.group, backend.dedupe)
    return batch.to(device)


def build_mask(batch: PairBatch, backend: Backend):
    """What the attention of every layer needs for this micro-batch, built once: varlen offsets, a FlexAttention
    BlockMask, a dense boolean mask, or the padded rows' mask."""
    if backend.name == "varlen":
        return attention.varlen_mask(batch)
    if backend.name == "flex":
        return attention.flex_block_mask(batch, backend.window)
    if backend.name == "dense":
        return attention.dense_mask(batch, backend.window)
    return batch.attention_mask


def target_hidden(model, batch: PairBatch, backend: Backend, mask=None, src: torch.Tensor | None = None) -> torch.Tensor:
    """(N, H) final hidden states at the positions that predict the N completion targets (or at the flattened
    positions `src`). A mask that names its own attention function (`attn_name`: varlen's offsets, or a
    sequence-parallel context) reaches every layer's attention as the keyword arguments of its `kwargs()`;
    transformers then builds no mask of its own."""
    if backend.vision is not None and backend.name == "padded":
        return padded_vision_hidden(model, batch, src)
    if mask is None:
        mask = build_mask(batch, backend)
    if backend.vision is not None:  # only the language model's layers switch attention: the vision tower keeps its own
        return packed_vision_hidden(model, batch, mask, src)
    name = getattr(mask, "attn_name", None)
    if name is not None:
        _set_attn(model, name)
        hidden = decoder(model)(input_ids=batch.input_ids, position_ids=batch.position_ids, use_cache=False,
                                **mask.kwargs()).last_hidden_state
    else:
        _set_attn(model, "sdpa" if backend.name == "padded" else attention.ATTN_NAME)
        hidden = decoder(model)(
            input_ids=batch.input_ids, position_ids=batch.position_ids, attention_mask=mask, use_cache=False
        ).last_hidden_state
    return hidden.reshape(-1, hidden.shape[-1]).index_select(0, batch.src if src is None else src)


def use_model_attention(model) -> None:
    """Give the model back its own attention (SDPA; a vision-language model's language model the one it was loaded
    with), e.g. before `generate`, after packed forwards."""
    if is_vision_config(base_causal_lm(model).config):
        language_attention(model)
    else:
        _set_attn(model, "sdpa")


def sequence_logps(model, batch: PairBatch, backend: Backend, mask=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sequence completion log-prob sums (2B,) fp32 and per-token log-probs (N,), for chosen then rejected."""
    hidden = target_hidden(model, batch, backend, mask)
    head = output_head(model)
    tok = token_logps(hidden, head.weight, batch.tgt, scale=head.scale, softcap=head.softcap, kernels=head.kernels)
    sums = sequence_sums(tok, batch.seq, batch.lengths.numel())
    return (sums if batch.seq_alias is None else sums[batch.seq_alias]), tok
