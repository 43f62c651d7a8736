"""Vision-language pairs (Qwen2-VL / Qwen2.5-VL / Qwen3-VL, and LLaVA) through the packed, prefix-shared layout
(DESIGN §1).

A multimodal pair is two sequences that share a prompt holding images:

    [prompt with image placeholders | chosen]   and   [prompt with image placeholders | rejected]

As for text (`fastdpo.data.pack`), both are computed in one packed row [prompt | chosen | rejected], the prompt
once. Three things differ from text:

1. Image features. A prompt's images run through the vision tower once per call, all images of the micro-batch in
   one call (`image_embeddings`), and their features replace the token embeddings at the placeholder positions
   (`merged_embeddings`). Each prompt appears once in the packed row, so each image's features are placed once; the
   two sequences of a pair see them through attention to the prompt. Separate forwards would run each image twice.
   Qwen3-VL adds DeepStack: its vision tower also returns the features of a few of its blocks (each through its own
   merger), and its language model adds the k-th of them to the hidden states at the placeholder positions after
   decoder layer k (`deepstack_visual_embeds`, `visual_pos_masks`). The packed row hands them over in the same order
   as the main features, so each image's are added once, at its one run of placeholders.

2. Positions. LLaVA's language model (Llama, Qwen2, Mistral) takes the plain 1-D positions `pack_pairs` writes:
   chosen continues the prompt and rejected restarts where chosen started, an image's placeholders count as text.
   Qwen2-VL, Qwen2.5-VL and Qwen3-VL take M-RoPE positions (`mrope_positions`): they rotate queries and keys by three
   position ids per token (temporal, height, width). A text token at text position p gets (p, p, p). An image
   whose placeholders start at position s, with a grid of t x h x w patches merged in m x m squares (h' = h / m,
   w' = w / m merged tokens per side), puts its t h' w' tokens, in row-major (t, h', w') order, at

       (s + i_t, s + i_h, s + i_w),   0 <= i_t < t, 0 <= i_h < h', 0 <= i_w < w'

   and the text after it resumes at one past the image's largest position, s + max(t, h', w') (still images have
   t = 1). So a prompt of P tokens ends at some position q (not P - 1 once an image is in it), chosen takes
   q + 1 .. q + C on all three axes, and rejected restarts at q + 1 (q + 1 .. q + R): exactly the positions the
   model gives [prompt | chosen] and [prompt | rejected] run separately. Qwen3-VL's own rule (its `get_rope_index`)
   resumes at s + max(h', w') and spaces video frames by their timestamps; for a still image (t = 1) both rules give
   the same positions. How the three axes share a head's frequencies (Qwen2-VL: in contiguous sections; Qwen3-VL:
   interleaved) is the model's rotary embedding's business: it takes the same (3, 1, T) positions.

3. The attention rule is the text one (`fastdpo.model.attention.allowed`: same pair, causal in packed order, a key
   is a prompt token or in the query's own segment), so the text backends serve it unchanged: on CUDA the varlen
   offsets (FlashAttention's variable-length kernel: memory linear in the tokens) or a FlexAttention BlockMask,
   through fastdpo's attention functions switched on for the language model's layers only; on the CPU a dense
   mask handed to the language model's own attention as a ready 4-D additive mask (0 where allowed, the dtype's
   minimum elsewhere), which its eager and SDPA attention both take as is. The positions never enter the mask:
   M-RoPE only rotates.

Then, as for text (DESIGN §4): the final hidden states at the positions that predict the completion tokens, through
the output head in chunks, float32 log-sum-exp, summed per sequence.

transformers API used: `model.get_image_features` (Qwen: `(pixel_values, image_grid_thw)`, the vision tower and its
patch merger, and for Qwen3-VL the output's `deepstack_features`, per DeepStack layer and image; LLaVA:
`(pixel_values, vision_feature_layer, vision_feature_select_strategy)` as its config gives them, the CLIP tower and
the projector: a fixed number of features per image), features per image, image after image,
`model.get_input_embeddings()`, the language model from `model.get_decoder()` called with `inputs_embeds`,
`position_ids` (3 rows for M-RoPE), a 4-D `attention_mask` and for Qwen3-VL `visual_pos_masks` and
`deepstack_visual_embeds`, `config.image_token_id` (and Qwen's `config.vision_config.spatial_merge_size`), and the
language model's own `config._attn_implementation`, switched per forward (`language_attention`). The M-RoPE
positions are computed here, not by the model's `get_rope_index` (the tests compare the two).

A prompt's pairs form one group [prompt with its images | y1 | ... | yK] (`pack_pairs(..., group=True)`) only where
they hold the same images, pixel for pixel (`fastdpo.data.pack.same_images`): two prompts with the same token ids
may hold different images. A group's images are placed once, its completions each restart where the first began.
Videos are not handled. The vision tower keeps the model's own attention: switching every
sub-config to fastdpo's attention (`backend.target_hidden` does so for text models) would break it, so only the
language model's layers are switched.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from fastdpo.data.pack import PairBatch, pack_pairs, pad_pairs
from fastdpo.data.tokenize import TokenizedPair, image_count
from fastdpo.errors import FastDPOError
from fastdpo.kernels.logprob_head import token_logps
from fastdpo.model import attention
from fastdpo.model.attention import sliding_window
from fastdpo.model.load import base_causal_lm, decoder
from fastdpo.model.logprobs import output_head, sequence_sums

# attention implementations of the language model that take a ready 4-D additive mask as it is
MASKED_ATTENTION = ("eager", "sdpa", attention.ATTN_NAME)
MROPE_FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")  # M-RoPE positions, images as patches with a grid
LLAVA_FAMILIES = ("llava",)  # 1-D positions, images as whole (C, H, W) pictures of a fixed size


@dataclass
class VisionPairBatch:
    """A micro-batch of B vision-language pairs in the packed layout.

    pairs: the text layout of `pack_pairs` (input_ids (1, T) with each prompt's image placeholders, targets, pair ids
      and segments); its `position_ids` are the plain 1-D ones and are not used by the model.
    positions: (3, 1, T) long, the M-RoPE positions (temporal, height, width) of every packed token; LLaVA: the
      plain (1, T) pack positions.
    pixel_values: the images, image after image in the order their placeholders appear in the row (pair after pair,
      in a prompt from left to right); None without images. Qwen: (patches, C * temporal_patch * patch^2) patches;
      LLaVA: (I, C, H, W) pictures.
    image_grid_thw: (I, 3) long, each image's (t, h, w) patch grid, in the same order; None without images or grids.
    """

    pairs: PairBatch
    positions: torch.Tensor
    pixel_values: torch.Tensor | None = None
    image_grid_thw: torch.Tensor | None = None

    @property
    def num_images(self) -> int:
        return image_count(self.pixel_values, self.image_grid_thw)

    def to(self, device: torch.device | str) -> VisionPairBatch:
        def move(v):
            return None if v is None else v.to(device)

        return VisionPairBatch(self.pairs.to(device), self.positions.to(device), move(self.pixel_values),
                               move(self.image_grid_thw))


class VisionIds(NamedTuple):
    """What the packed layout needs of a vision-language model's config: its image placeholder token id, and for the
    M-RoPE families (Qwen2-VL, Qwen2.5-VL, Qwen3-VL) the spatial merge size; None for LLaVA (1-D positions)."""

    image_token_id: int
    merge_size: int | None = None

    @property
    def mrope(self) -> bool:
        return self.merge_size is not None


def vision_ids(config) -> VisionIds:
    """`VisionIds` of a vision-language model config (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, LLaVA)."""
    vision = getattr(config, "vision_config", None)
    family = getattr(config, "model_type", "?")
    if getattr(config, "image_token_id", None) is None or vision is None or family not in MROPE_FAMILIES + LLAVA_FAMILIES:
        raise FastDPOError(f"model_type {family!r} has no image placeholder token or vision tower config fastdpo "
                           "reads: vision-language pairs need a Qwen2-VL, Qwen2.5-VL, Qwen3-VL or LLaVA model.")
    if family in LLAVA_FAMILIES:
        return VisionIds(int(config.image_token_id))
    return VisionIds(int(config.image_token_id), int(vision.spatial_merge_size))


def mrope_positions(input_ids: torch.Tensor, pair_lengths, image_grid_thw: torch.Tensor | None, image_token_id: int,
                    spatial_merge_size: int) -> torch.Tensor:
    """(3, 1, T) long M-RoPE positions of a packed row (the module docstring, point 2).

    input_ids (1, T) the packed row; pair_lengths: (prompt, y1, ..., yK) tokens of each run in packed order (a pair:
    prompt, chosen, rejected; `PairBatch.pair_lengths`); image_grid_thw (I, 3) the grids of the images in the order
    their placeholders appear.
    A run of an image's t h' w' placeholders takes the next grid; trailing filler gets position 0 like text filler."""
    ids = input_ids[0].tolist()
    grids = [] if image_grid_thw is None else image_grid_thw.tolist()
    chunks: list[torch.Tensor] = []
    image = off = 0

    def text(start: int, n: int) -> None:
        chunks.append(torch.arange(start, start + n).expand(3, n))

    for pair, run in enumerate(pair_lengths):
        n_prompt, *completions = run
        pos = i = 0  # next text position, next prompt token
        while i < n_prompt:
            if ids[off + i] != image_token_id:
                j = i
                while j < n_prompt and ids[off + j] != image_token_id:
                    j += 1
                text(pos, j - i)
                pos += j - i
                i = j
                continue
            if image >= len(grids):
                raise FastDPOError(f"pair {pair}: more image placeholder runs than images ({len(grids)}).")
            t, h, w = grids[image]
            image += 1
            if t != 1:
                raise FastDPOError(f"image {image - 1} has a temporal grid of {t}; still images have 1 (videos are "
                                   "not supported).")
            hm, wm = h // spatial_merge_size, w // spatial_merge_size
            n = t * hm * wm
            if i + n > n_prompt or ids[off + i : off + i + n] != [image_token_id] * n:
                raise FastDPOError(f"image {image - 1} (grid {t}x{h}x{w}) needs {n} placeholder tokens in its prompt.")
            grid = torch.stack(torch.meshgrid(torch.arange(t), torch.arange(hm), torch.arange(wm), indexing="ij"))
            chunks.append(grid.reshape(3, n) + pos)
            pos += max(t, hm, wm)
            i += n
        for n in completions:  # each completion restarts where the first started (rejected where chosen did)
            text(pos, n)
        off += n_prompt + sum(completions)
    if image != len(grids):
        raise FastDPOError(f"{len(grids)} images for {image} image placeholder runs in the pairs' prompts.")
    chunks.append(torch.zeros(3, len(ids) - off, dtype=torch.long))
    return torch.cat(chunks, dim=1).unsqueeze(1).to(input_ids.device)


def pack_vision_pairs(pairs: list[TokenizedPair], config, pixel_values: torch.Tensor | None = None,
                      image_grid_thw: torch.Tensor | None = None, pad_id: int = 0) -> VisionPairBatch:
    """Pairs whose prompts hold image placeholders (each image's run of `image_token_id` tokens already expanded, as
    the model's processor writes them) laid out as one packed row, with their positions (Qwen: M-RoPE).
    `pixel_values` / `image_grid_thw`: the images of all pairs, in the order their placeholders appear (pair after
    pair), as the model's image processor gives them (a pair without images contributes none; LLaVA: no grids).
    `config`: the model's config (`vision_ids`)."""
    batch = pack_pairs(pairs, 1, pad_id)
    ids = vision_ids(config)
    with_images(batch, ids, pixel_values, image_grid_thw)
    return VisionPairBatch(batch, batch.vision_positions if ids.mrope else batch.position_ids, pixel_values,
                           image_grid_thw)


def with_images(batch: PairBatch, ids: VisionIds, pixel_values: torch.Tensor | None,
                image_grid_thw: torch.Tensor | None) -> PairBatch:
    """`batch` (the packed or the padded layout, on the host) given its images: `pixel_values`, `image_grid_thw`
    (Qwen), and in the packed layout of an M-RoPE model its positions (`PairBatch.vision_positions`). `ids`:
    `vision_ids` of the model."""
    if ids.mrope:
        if (pixel_values is None) != (image_grid_thw is None):
            raise FastDPOError("pixel_values and image_grid_thw come together.")
        if image_grid_thw is not None and int(image_grid_thw.prod(-1).sum()) != pixel_values.shape[0]:
            raise FastDPOError(f"pixel_values has {pixel_values.shape[0]} patches, image_grid_thw says "
                               f"{int(image_grid_thw.prod(-1).sum())}.")
    elif image_grid_thw is not None or (pixel_values is not None and pixel_values.dim() != 4):
        raise FastDPOError("LLaVA takes its images as (images, channels, height, width) pixel_values, without grids.")
    batch.pixel_values, batch.image_grid_thw = pixel_values, image_grid_thw
    if batch.attention_mask is None and ids.mrope:
        batch.vision_positions = mrope_positions(batch.input_ids, batch.pair_lengths, image_grid_thw, *ids)
    return batch


def pair_images(pairs: list[TokenizedPair], times: int = 1) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(pixel_values, image_grid_thw) of the pairs' images, pair after pair (`times` over: the padded layout holds
    each prompt twice); (None, None) when none has an image, and no grids for images without them (LLaVA)."""
    held = [p for p in pairs if p.num_images]
    if not held:
        return None, None
    pixels = torch.cat([p.pixel_values for p in held])
    pixels = pixels.repeat(times, *[1] * (pixels.dim() - 1))
    if held[0].image_grid_thw is None:
        return pixels, None
    return pixels, torch.cat([p.image_grid_thw for p in held]).long().repeat(times, 1)


def vision_batch(pairs: list[TokenizedPair], ids: VisionIds, pad_id: int = 0, prompt_targets: bool = False,
                 padded: bool = False, pad_to_multiple: int = 1, group: bool = False, dedupe: bool = True) -> PairBatch:
    """A micro-batch of pairs that may hold images (`TokenizedPair.pixel_values`), on the host: one packed row with
    its positions (filler up to a multiple of `pad_to_multiple`; with `group`, a prompt's pairs that hold the same
    images as one run, their images once), or with `padded` the plain layout of 2B rows (prompt+chosen, then
    prompt+rejected), each pair's images once per row. `ids`: `vision_ids` of the model."""
    if padded:
        return with_images(pad_pairs(pairs, pad_id, prompt_targets), ids, *pair_images(pairs, 2))
    batch = pack_pairs(pairs, pad_to_multiple, pad_id, prompt_targets, group, dedupe)
    return with_images(batch, ids, *pair_images([pairs[i] for i in batch.unit_heads]))


class ImageFeatures(NamedTuple):
    """The vision tower's output for all images of a micro-batch, image after image.

    merged: (tokens, H) the features that replace the placeholders' token embeddings.
    deepstack: Qwen3-VL's DeepStack features, one (tokens, H) tensor per DeepStack layer, in the same token order,
      added to the language model's hidden states after its first decoder layers; empty for the other families."""

    merged: torch.Tensor
    deepstack: tuple[torch.Tensor, ...] = ()


def vision_features(model, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor | None = None) -> ImageFeatures:
    """`ImageFeatures` of all images of a micro-batch: one call of the vision tower (Qwen: patch embedding, its blocks,
    the patch merger, and Qwen3-VL's DeepStack mergers; LLaVA: the CLIP tower at the config's feature layer and
    selection, then the projector) over all of them, whatever the number of pairs."""
    lm = base_causal_lm(model)
    if vision_ids(lm.config).mrope:
        out = lm.get_image_features(pixel_values, image_grid_thw)
    else:
        out = lm.get_image_features(pixel_values, vision_feature_layer=lm.config.vision_feature_layer,
                                    vision_feature_select_strategy=lm.config.vision_feature_select_strategy)
    deepstack = tuple(_joined(layer) for layer in getattr(out, "deepstack_features", None) or ())
    return ImageFeatures(_joined(getattr(out, "pooler_output", out)), deepstack)


def _joined(features) -> torch.Tensor:
    """transformers 5 splits features per image (a tuple); one (tokens, H) tensor."""
    return torch.cat(list(features), dim=0) if isinstance(features, (tuple, list)) else features


def image_embeddings(model, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor | None = None) -> torch.Tensor:
    """(tokens, H) the features of all images of a micro-batch that replace their placeholders (`vision_features`)."""
    return vision_features(model, pixel_values, image_grid_thw).merged


def merged_embeddings(model, input_ids: torch.Tensor, features: torch.Tensor | None, image_token_id: int
                      ) -> torch.Tensor:
    """(1, T, H) token embeddings of the packed row with the image features in place of the placeholders, in order:
    the k-th placeholder token of the row takes row k of `features`."""
    embeds = base_causal_lm(model).get_input_embeddings()(input_ids)
    where = (input_ids[0] == image_token_id).nonzero().squeeze(1)
    n = 0 if features is None else features.shape[0]
    if where.numel() != n:
        raise FastDPOError(f"{where.numel()} image placeholder tokens in the row, {n} image features.")
    if n == 0:
        return embeds
    return embeds[0].index_copy(0, where, features.to(embeds.dtype)).unsqueeze(0)


def deepstack_inputs(input_ids: torch.Tensor, features: ImageFeatures | None, image_token_id: int,
                     dtype: torch.dtype) -> dict:
    """The language model's DeepStack keyword arguments for a row (Qwen3-VL): the placeholder positions and, per
    DeepStack layer, the features to add there (row k to the k-th placeholder, as `merged_embeddings` places them);
    none for a row without images or a model without DeepStack."""
    if features is None or not features.deepstack:
        return {}
    return {"visual_pos_masks": input_ids == image_token_id,
            "deepstack_visual_embeds": [f.to(dtype) for f in features.deepstack]}


def language_attention(model, name: str | None = None) -> str:
    """Run the language model's layers with attention function `name` (None: the model's own, as it was loaded);
    the vision tower keeps its own. Returns the implementation now set. transformers reads it at each forward."""
    text = decoder(model)
    own = text.__dict__.setdefault("_fastdpo_own_attn", text.config._attn_implementation)
    want = own if name is None else name
    if text.config._attn_implementation != want:
        attention.switch_attention(text, want)
    return want


def check_language_model(model, masked: bool = True) -> None:
    """The packed forward's mask is the language model's whole attention rule: no sliding window; for a dense mask
    (`masked`), an own attention that takes a ready additive mask."""
    text = decoder(model)
    impl = text.__dict__.get("_fastdpo_own_attn", getattr(text.config, "_attn_implementation", None))
    if masked and impl not in MASKED_ATTENTION:
        raise FastDPOError(f"vision-language pairs on the dense mask run the language model with attention "
                           f"{list(MASKED_ATTENTION)}, not {impl!r}: load the model with attn_implementation='sdpa'.")
    ok, window, reason = sliding_window(text.config)
    if not ok or window is not None:
        raise FastDPOError(f"vision-language pairs: the language model's {reason or 'sliding window'} is not "
                           "supported by the packed layout.")


def packed_vision_hidden(model, batch: PairBatch, mask=None, src: torch.Tensor | None = None) -> torch.Tensor:
    """(N, H) final hidden states of a packed batch with images (`vision_batch`) at the positions that predict its
    completion targets (or at the flattened positions `src`): the vision tower once over all of the batch's images,
    their features in place of the placeholders, then the language model alone with the packed positions (M-RoPE
    for Qwen, the plain pack positions for LLaVA), the pair rule, and Qwen3-VL's DeepStack features. `mask`, built
    once per micro-batch (`backend.build_mask`): varlen offsets (a mask that names its attention function, whose
    keyword arguments reach every layer), a FlexAttention BlockMask, or the boolean `attention.dense_mask` (the
    default), given as an additive mask to the language model's own attention."""
    if mask is None:
        mask = attention.dense_mask(batch)
    dense = isinstance(mask, torch.Tensor)
    check_language_model(model, masked=dense)
    ids = vision_ids(base_causal_lm(model).config)
    features = None
    if batch.pixel_values is not None:
        features = vision_features(model, batch.pixel_values, batch.image_grid_thw)
    embeds = merged_embeddings(model, batch.input_ids, None if features is None else features.merged,
                               ids.image_token_id)
    deepstack = deepstack_inputs(batch.input_ids, features, ids.image_token_id, embeds.dtype)
    positions = batch.vision_positions if ids.mrope else batch.position_ids
    assert positions is not None and positions.shape[-1] == batch.input_ids.shape[1]
    text = decoder(model)
    name = getattr(mask, "attn_name", None)
    if name is not None:  # varlen offsets (or a sequence-parallel context)
        language_attention(model, name)
        hidden = text(inputs_embeds=embeds, position_ids=positions, use_cache=False, **deepstack,
                      **mask.kwargs()).last_hidden_state
    else:
        if dense:
            language_attention(model)
            mask = torch.zeros(mask.shape, dtype=embeds.dtype, device=mask.device).masked_fill(
                ~mask, torch.finfo(embeds.dtype).min)
        else:  # a FlexAttention BlockMask, which fastdpo's attention function takes
            language_attention(model, attention.ATTN_NAME)
        hidden = text(inputs_embeds=embeds, position_ids=positions, attention_mask=mask, use_cache=False,
                      **deepstack).last_hidden_state
    return hidden.reshape(-1, hidden.shape[-1]).index_select(0, batch.src if src is None else src)


def padded_vision_hidden(model, batch: PairBatch, src: torch.Tensor | None = None) -> torch.Tensor:
    """The same for the padded layout, through the model's own multimodal forward (its vision tower on every row's
    images, its positions (Qwen: its rope index), its attention): the plain computation the packed one is held to."""
    lm = base_causal_lm(model)
    ids = vision_ids(lm.config)
    language_attention(model)
    kw = {} if batch.pixel_values is None else {"pixel_values": batch.pixel_values}
    if ids.mrope:
        kw["mm_token_type_ids"] = (batch.input_ids == ids.image_token_id).int()
        if batch.image_grid_thw is not None:
            kw["image_grid_thw"] = batch.image_grid_thw
    else:
        kw["position_ids"] = batch.position_ids
    hidden = lm.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False,
                      **kw).last_hidden_state
    return hidden.reshape(-1, hidden.shape[-1]).index_select(0, batch.src if src is None else src)


def vision_target_hidden(model, batch: VisionPairBatch) -> torch.Tensor:
    """(N, H) final hidden states at the packed positions that predict the N completion targets."""
    return packed_vision_hidden(model, batch.pairs)


def vision_sequence_logps(model, batch: VisionPairBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """Completion log-prob sums (2B,) float32, chosen of pairs 0..B-1 then rejected, and the per-token log-probs
    (N,), of vision-language pairs in the packed layout: the vision tower once per image, the prompt once per pair."""
    hidden = vision_target_hidden(model, batch)
    head = output_head(model)
    tok = token_logps(hidden, head.weight, batch.pairs.tgt, scale=head.scale, softcap=head.softcap,
                      kernels=head.kernels)
    return sequence_sums(tok, batch.pairs.seq, batch.pairs.lengths.numel()), tok
