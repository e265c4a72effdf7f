"""Inputs for composite text models: image placeholders a Q-Former fills, side inputs a forward requires.

``composite_builder`` picks a builder before the main-input dispatch when the model is one
of these shapes: BLIP-2-style (``num_query_tokens`` placeholders spliced into the text and
filled from the image), or a text model whose forward needs more than ids (LXMERT's region
features, X-MOD's language ids, Kosmos-2's image positions, IDEFICS' per-image cross-attention,
CANINE's code points). It returns ``None`` for every other model.
"""

from __future__ import annotations

from collections.abc import Callable
from fractions import Fraction

import torch
from transformers import PretrainedConfig

from pytest_modelpatch.families.inputs.prompts import (
    class_list_inputs,
    point_prompt_inputs,
    takes_class_list,
    takes_point_prompt,
    takes_text_prompt,
    text_prompt_inputs,
)
from pytest_modelpatch.families.inputs.request import InputRequest
from pytest_modelpatch.families.inputs.text import text_companions, text_inputs, text_request_inputs
from pytest_modelpatch.families.inputs.vision import pixel_values
from pytest_modelpatch.families.shrink.rules.timm import FASTVIT_MCI_STRIDE, PE_PATCH

Builder = Callable[[InputRequest], "dict[str, torch.Tensor]"]

VIDEO_FRAMES = 2


def composite_builder(request: InputRequest) -> Builder | None:
    """The builder for ``request`` when its model is one of this module's shapes."""
    for applies, builder in COMPOSITE_BUILDERS:
        if applies(request):
            return builder
    return None


def _takes_query_tokens(request: InputRequest) -> bool:
    return (
        isinstance(getattr(request.config, "num_query_tokens", None), int)
        and {"pixel_values", "input_ids"} <= request.params
    )


def query_token_inputs(request: InputRequest) -> dict[str, torch.Tensor]:
    """BLIP-2 / InstructBLIP(-Video): one image (or clip) per row whose Q-Former output fills
    ``num_query_tokens`` placeholders (per frame) at the start of the text."""
    config, batch = request.config, request.batch_size
    video = getattr(config, "video_token_id", None) is not None and "video" in config.model_type
    frames = VIDEO_FRAMES if video else 1
    placeholder = config.video_token_id if video else getattr(config, "image_token_id", None)
    inputs = text_request_inputs(request)
    if placeholder is not None:
        tokens = torch.full((batch, config.num_query_tokens * frames), placeholder, dtype=torch.long)
        inputs["input_ids"] = torch.cat([tokens, inputs["input_ids"]], dim=1)
        inputs["attention_mask"] = torch.ones_like(inputs["input_ids"])
    images = pixel_values(config, batch * frames, request.generator)
    inputs["pixel_values"] = images.reshape(batch, frames, *images.shape[1:]) if video else images
    if request.takes("qformer_input_ids"):
        vocab = config.qformer_config.vocab_size
        qformer = torch.randint(vocab, (batch, request.seq_len), generator=request.generator)
        inputs |= {"qformer_input_ids": qformer, "qformer_attention_mask": torch.ones_like(qformer)}
    if config.is_encoder_decoder or request.takes("decoder_input_ids") and request.requires("decoder_input_ids"):
        inputs["decoder_input_ids"] = text_request_inputs(request)["input_ids"]
    return inputs


def _takes_region_features(request: InputRequest) -> bool:
    return {"visual_feats", "visual_pos"} <= request.params and hasattr(request.config, "visual_feat_dim")


def region_feature_inputs(request: InputRequest) -> dict[str, torch.Tensor]:
    """LXMERT-style: text plus detector region features and their boxes (x1, y1, x2, y2 in [0, 1])."""
    config, batch = request.config, request.batch_size
    inputs = text_request_inputs(request)
    if request.takes("token_type_ids"):
        inputs["token_type_ids"] = torch.zeros_like(inputs["input_ids"])
    regions = 4
    corners = torch.rand(batch, regions, 2, 2, generator=request.generator).sort(dim=2).values
    inputs["visual_feats"] = request.randn(batch, regions, config.visual_feat_dim)
    inputs["visual_pos"] = corners.transpose(2, 3).reshape(batch, regions, 4)[..., : config.visual_pos_dim]
    return inputs


def _takes_language_ids(request: InputRequest) -> bool:
    return "lang_ids" in request.params and bool(getattr(request.config, "languages", None))


def language_adapter_inputs(request: InputRequest) -> dict[str, torch.Tensor]:
    """X-MOD: each row names its language, picking the adapter (the forward refuses to guess)."""
    inputs = text_request_inputs(request)
    if request.takes("token_type_ids") and getattr(request.config, "type_vocab_size", None):
        inputs["token_type_ids"] = torch.zeros_like(inputs["input_ids"])
    languages = len(request.config.languages)
    rows = torch.arange(request.batch_size) % languages  # different adapters in one batch
    inputs["lang_ids"] = rows
    return inputs


def _takes_image_position_mask(request: InputRequest) -> bool:
    return "image_embeds_position_mask" in request.params and hasattr(request.config, "latent_query_num")


def image_position_inputs(request: InputRequest) -> dict[str, torch.Tensor]:
    """Kosmos-2: after two text tokens, ``latent_query_num`` positions the image features replace."""
    config, batch = request.config, request.batch_size
    inputs = text_request_inputs(request)
    ids, slots = inputs["input_ids"], config.latent_query_num
    filler = ids[:, :1].expand(batch, slots)  # any ordinary id: the image embeds overwrite these positions
    inputs["input_ids"] = torch.cat([ids[:, :2], filler, ids[:, 2:]], dim=1)
    inputs["attention_mask"] = torch.ones_like(inputs["input_ids"])
    mask = torch.zeros_like(inputs["input_ids"])
    mask[:, 2 : 2 + slots] = 1
    inputs["image_embeds_position_mask"] = mask
    inputs["pixel_values"] = pixel_values(config, batch, request.generator)
    return inputs


def _takes_image_cross_attention(request: InputRequest) -> bool:
    return {"pixel_values", "image_attention_mask", "input_ids"} <= request.params and hasattr(
        request.config, "vision_config"
    )


def image_cross_attention_inputs(request: InputRequest) -> dict[str, torch.Tensor]:
    """IDEFICS (Flamingo-style): images per row, ``(batch, images, C, H, W)``, that every text
    token attends to through the gated cross-attention layers."""
    config, batch, images = request.config, request.batch_size, 2
    inputs = text_request_inputs(request)
    pixels = pixel_values(config, batch * images, request.generator)
    inputs["pixel_values"] = pixels.reshape(batch, images, *pixels.shape[1:])
    inputs["image_attention_mask"] = torch.ones(batch, request.seq_len, images, dtype=torch.long)
    return inputs


def _takes_query_embeds(request: InputRequest) -> bool:
    return request.requires("query_embeds")


def query_embed_inputs(request: InputRequest) -> dict[str, torch.Tensor]:
    """A bare Q-Former: learned-query embeddings that cross-attend to image features."""
    config, batch = request.config, request.batch_size
    inputs = {"query_embeds": request.randn(batch, request.seq_len, config.hidden_size)}
    width = getattr(config, "encoder_hidden_size", None)
    if width and request.takes("encoder_hidden_states"):
        inputs["encoder_hidden_states"] = request.randn(batch, 2 * request.seq_len, width)
    return inputs


def _takes_codepoints(request: InputRequest) -> bool:
    config = request.config
    return (
        "input_ids" in request.params and hasattr(config, "num_hash_buckets") and not getattr(config, "vocab_size", 0)
    )


def codepoint_inputs(request: InputRequest) -> dict[str, torch.Tensor]:
    """CANINE reads Unicode code points (hashed into buckets), not ids of a vocabulary: printable ASCII."""
    ids = torch.randint(32, 127, (request.batch_size, request.seq_len), generator=request.generator)
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    if request.takes("token_type_ids"):
        inputs["token_type_ids"] = torch.zeros_like(ids)
    return inputs


def _takes_pooled_patches(request: InputRequest) -> bool:
    return {"pixel_values", "image_token_pooling", "image_grids"} <= request.params


def pooled_patch_inputs(request: InputRequest) -> dict[str, torch.Tensor]:
    """Molmo2: one crop per row as flattened patches; each image token pools a 2x2 block of them."""
    config, batch = request.config, request.batch_size
    vision = config.vision_config
    side = int(vision.num_position_embeddings**0.5)  # patches per crop side
    patches, volume = side * side, vision.num_channels * vision.patch_size**2
    grid = torch.arange(patches).reshape(side // 2, 2, side // 2, 2).permute(0, 2, 1, 3).reshape(-1, 4)
    tokens = grid.shape[0]
    inputs = text_request_inputs(request)
    placeholders = torch.full((batch, tokens), config.image_token_id, dtype=torch.long)
    inputs["input_ids"] = torch.cat([inputs["input_ids"][:, :2], placeholders, inputs["input_ids"][:, 2:]], dim=1)
    inputs["attention_mask"] = torch.ones_like(inputs["input_ids"])
    inputs["pixel_values"] = request.randn(batch, patches, volume)
    inputs["image_token_pooling"] = torch.cat([grid + row * patches for row in range(batch)])
    inputs["image_grids"] = torch.tensor([[side // 2, side // 2, 0, 0]] * batch)
    return inputs


def _takes_protein(request: InputRequest) -> bool:
    return {"input_ids", "protein_input_ids"} <= request.params and hasattr(request.config, "protein_encoder_config")


def protein_text_inputs(request: InputRequest) -> dict[str, torch.Tensor]:
    """Evolla: a question in text beside a protein sequence its SaProt encoder reads (ids past the
    encoder's special tokens <cls> <pad> <eos> <unk>)."""
    protein = request.config.protein_encoder_config
    inputs = text_request_inputs(request)
    ids = torch.randint(4, protein.vocab_size, (request.batch_size, 2 * request.seq_len), generator=request.generator)
    inputs |= {"protein_input_ids": ids, "protein_attention_mask": torch.ones_like(ids)}
    return inputs


def _takes_action_embeds(request: InputRequest) -> bool:
    return request.requires("action_embeds") and hasattr(request.config, "vlm_config")


def action_prefix_inputs(request: InputRequest) -> dict[str, torch.Tensor]:
    """PI0: a PaliGemma prefix (image placeholders first, then the instruction) and the noisy
    state + action embeddings the action expert denoises against it."""
    config, batch = request.config, request.batch_size
    vlm = config.vlm_config
    vision = vlm.vision_config
    patches = (vision.image_size // vision.patch_size) ** 2
    inputs = text_inputs(vlm, batch, request.seq_len, request.generator)
    placeholders = torch.full((batch, patches), vlm.image_token_id, dtype=torch.long)
    inputs["input_ids"] = torch.cat([placeholders, inputs["input_ids"]], dim=1)
    inputs["attention_mask"] = torch.ones_like(inputs["input_ids"])
    # one camera per row: (batch, cameras, C, H, W), and which camera slots hold an image
    inputs["pixel_values"] = pixel_values(vlm, batch, request.generator)[:, None]
    inputs["pixel_attention_mask"] = torch.ones(batch, 1, dtype=torch.bool)
    steps = 1 + request.seq_len // 2  # the state token, then a short action chunk
    inputs["action_embeds"] = request.randn(batch, steps, config.dit_config.hidden_size)
    return inputs


def _takes_draft_context(request: InputRequest) -> bool:
    return request.requires("noise_embeds") and request.requires("context_hidden_states")


def draft_block_inputs(request: InputRequest) -> dict[str, torch.Tensor]:
    """A block-diffusion draft model (Muse Glimmer assistant): one block of noisy embeddings, and
    the target model's hidden states at ``target_layer_ids`` for the accepted context."""
    config, batch = request.config, request.batch_size
    width = config.hidden_size
    return {
        "noise_embeds": request.randn(batch, config.block_size, width),
        "context_hidden_states": request.randn(batch, request.seq_len, width * len(config.target_layer_ids)),
        # keys and values span the context and the block: without a cache only the mask says so
        "attention_mask": torch.ones(batch, request.seq_len + config.block_size, dtype=torch.long),
    }


def _patch_grid(config: PretrainedConfig) -> int:
    vision = config.vision_config
    return (vision.image_size // vision.patch_size) ** 2


def _halved(side: int, times: int) -> int:
    """A feature-map side after ``times`` stride-2, padding-1 convolutions (ceil division)."""
    for _ in range(times):
        side = (side + 1) // 2
    return side


def _sam_queries(config: PretrainedConfig) -> int:
    """DeepSeek-OCR-style SAM tower: patch grid side after its stride-2 neck convolutions."""
    sam = config.vision_config.sam_config
    return _halved(sam.image_size // sam.patch_size, len(sam.downsample_channels))


def _ocr_rows_with_newlines(config: PretrainedConfig) -> int:
    # Unlimited-OCR: every row of the global view ends with a newline token, then one view separator
    side = _sam_queries(config)
    return side * (side + 1) + 1


def _ocr2_queries(config: PretrainedConfig) -> int:
    # DeepSeek-OCR 2: the encoder emits its learned queries (144 up to a 12x12 grid, else 256)
    # whatever the patch count, then one view separator
    return (144 if _sam_queries(config) ** 2 <= 144 else 256) + 1


def _florence_tokens(config: PretrainedConfig) -> int:
    # DaViT: one conv per stage (kernel, stride, padding each), then one token per spatial
    # position plus the temporal mean of the single frame
    vision, side = config.vision_config, 32  # pixel_values' default size: DaViT's config has none
    for kernel, stride, pad in zip(vision.patch_size, vision.patch_stride, vision.patch_padding):
        side = (side + 2 * pad - kernel) // stride + 1
    return side * side + 1


def _vq_tokens(config: PretrainedConfig) -> int:
    # Chameleon: the VQGAN halves the image once per channel-multiplier stage but the last,
    # and each latent cell becomes one image token
    vq = config.vq_config
    return (vq.resolution // 2 ** (len(vq.channel_multiplier) - 1)) ** 2


def _anyres_tokens(config: PretrainedConfig) -> int:
    # Granite 4 Vision (LLaVA-NeXT anyres): an image exactly the first pinpoint is the base
    # tile plus that grid of tiles, each tile's patches downsampled by downsample_rate; the
    # grid's rows end in a newline token, and an exact fit unpads nothing
    vision, (height, width) = config.vision_config, config.image_grid_pinpoints[0]
    side = int(vision.image_size // vision.patch_size * Fraction(config.downsample_rate))
    rows, columns = height // vision.image_size * side, width // vision.image_size * side
    return side * side + rows * (columns + 1)


# LLaVA-style models whose image-feature count per image no config key states: model type ->
# placeholders per image, from the (shrunk) config.
IMAGE_TOKENS_PER_IMAGE: dict[str, Callable[[PretrainedConfig], int]] = {
    "cohere2_vision": lambda c: _patch_grid(c) // c.downsample_factor**2,  # pixel-shuffle projector
    "janus": _patch_grid,  # SigLIP patches, one token each
    "unlimited_ocr": _ocr_rows_with_newlines,
    "deepseek_ocr2": _ocr2_queries,
    "step3p7": lambda c: _halved(c.vision_config.image_size // c.vision_config.patch_size, 2),  # 2 stride-2 convs
    "florence2": _florence_tokens,
    "chameleon": _vq_tokens,
    # Emu3: VQ latent cells plus an end-of-row token per latent row (image_sizes below)
    "emu3": lambda c: _vq_tokens(c) + c.vq_config.resolution // 2 ** (len(c.vq_config.channel_multiplier) - 1),
    "deepseek_vl_hybrid": _patch_grid,  # the aligner keeps the low-res SigLIP grid, high-res SAM fused in
    "granite4_vision": _anyres_tokens,
    # Llama 4: the adapter pixel-shuffles ratio**-2 patches into one token
    "llama4": lambda c: int(_patch_grid(c) * c.vision_config.pixel_shuffle_ratio**2),
    # the timm towers (shrink/rules/timm.py): MobileNetV5's fusion grid, FastViT-MCi's
    # stride-64 grid, the Perception Encoder's patch grid pooled by the projector
    "gemma3n": lambda c: c.vision_soft_tokens_per_image,
    "fast_vlm": lambda c: (c.vision_config.image_size // FASTVIT_MCI_STRIDE) ** 2,
    "perception_lm": lambda c: (c.vision_config.image_size // PE_PATCH // max(c.projector_pooling_ratio, 1)) ** 2,
}


def _anyres_tiles(request: InputRequest, pixels: torch.Tensor) -> dict[str, torch.Tensor]:
    # the base view then the pinpoint's tiles, (batch, tiles, C, tile, tile), at the image's size
    config = request.config
    height, width = config.image_grid_pinpoints[0]
    tiles = 1 + (height // pixels.shape[-2]) * (width // pixels.shape[-1])
    return {
        "pixel_values": request.randn(pixels.shape[0], tiles, *pixels.shape[1:]),
        "image_sizes": torch.tensor([[height, width]] * pixels.shape[0]),
    }


def _image_sizes(request: InputRequest, pixels: torch.Tensor) -> dict[str, torch.Tensor]:
    # Emu3 crops each image's VQ codes to its (height, width): the whole image here
    return {"image_sizes": torch.tensor([list(pixels.shape[-2:])] * pixels.shape[0])}


def _high_res_view(request: InputRequest, pixels: torch.Tensor) -> dict[str, torch.Tensor]:
    # DeepSeek-VL hybrid: the same picture again at the SAM tower's size, for its high-res branch
    high = request.config.high_res_vision_config
    return {
        "high_res_pixel_values": request.randn(pixels.shape[0], high.num_channels, high.image_size, high.image_size)
    }


def _one_tile(request: InputRequest, pixels: torch.Tensor) -> dict[str, torch.Tensor]:
    # PerceptionLM takes (batch, tiles, C, H, W) and flattens the tiles into the batch
    return {"pixel_values": pixels.unsqueeze(1)}


# Metadata a family's forward needs beside the spliced image: model type -> extra inputs.
IMAGE_SIDE_INPUTS: dict[str, Callable[[InputRequest, torch.Tensor], dict[str, torch.Tensor]]] = {
    "perception_lm": _one_tile,
    "emu3": _image_sizes,
    "deepseek_vl_hybrid": _high_res_view,
    "granite4_vision": _anyres_tiles,
}


def _takes_spliced_image(request: InputRequest) -> bool:
    return request.config.model_type in IMAGE_TOKENS_PER_IMAGE and "pixel_values" in request.params


def spliced_image_inputs(request: InputRequest) -> dict[str, torch.Tensor]:
    """One image per row whose features replace as many image placeholders after two text tokens."""
    config, batch = request.config, request.batch_size
    count = IMAGE_TOKENS_PER_IMAGE[config.model_type](config)
    inputs = text_request_inputs(request)
    # decoder ids of an encoder-decoder (Florence-2) are the plain text, without placeholders
    inputs.update(text_companions(config, request.model_class, inputs["input_ids"]))
    placeholders = torch.full((batch, count), config.image_token_id, dtype=torch.long)
    inputs["input_ids"] = torch.cat([inputs["input_ids"][:, :2], placeholders, inputs["input_ids"][:, 2:]], dim=1)
    inputs["attention_mask"] = torch.ones_like(inputs["input_ids"])
    inputs["pixel_values"] = pixel_values(config, batch, request.generator)
    side = IMAGE_SIDE_INPUTS.get(config.model_type)
    if side is not None:
        inputs.update(side(request, inputs["pixel_values"]))
    return inputs


_IMAGE_GRID = (1, 4, 4)  # (frames, patch rows, patch columns): one 2x2 block per merged token


def _merged(config: PretrainedConfig) -> tuple[int, int]:
    vision = config.vision_config
    merge = getattr(vision, "spatial_merge_size", None) or vision.merge_size
    return _IMAGE_GRID[1] // merge, _IMAGE_GRID[2] // merge


def _hunyuan_tokens(config: PretrainedConfig) -> int:
    # a newline after each merged row, and begin/end embeddings around the image
    rows, columns = _merged(config)
    return rows * (columns + 1) + 2


# Packed-patch VLMs with ``image_grid_thw`` that the Qwen-VL rule does not recognise (no
# temporal_patch_size / in_channels): model type -> (values per patch, placeholders per image).
GRID_IMAGE_FAMILIES: dict[str, tuple[Callable[[PretrainedConfig], int], Callable[[PretrainedConfig], int]]] = {
    "hunyuan_vl": (lambda c: c.vision_config.num_channels * c.vision_config.patch_size**2, _hunyuan_tokens),
    # Muse Spark's patch embedding is a linear over patch_temporal RGB frames of a patch
    "muse_spark": (
        lambda c: c.vision_config.patch_temporal * 3 * c.vision_config.patch_size**2,
        lambda c: _merged(c)[0] * _merged(c)[1],
    ),
    "dots3_note": (
        lambda c: c.vision_config.num_channels * c.vision_config.patch_size**2,
        lambda c: _merged(c)[0] * _merged(c)[1],
    ),
}


def _takes_packed_grid_image(request: InputRequest) -> bool:
    return request.config.model_type in GRID_IMAGE_FAMILIES and {"pixel_values", "image_grid_thw"} <= request.params


def packed_grid_image_inputs(request: InputRequest) -> dict[str, torch.Tensor]:
    """One 4x4-patch image per row, as flattened patches plus ``image_grid_thw``, its merged
    tokens as placeholders after two text tokens."""
    config, batch = request.config, request.batch_size
    volume, tokens = (rule(config) for rule in GRID_IMAGE_FAMILIES[config.model_type])
    inputs = text_request_inputs(request)
    placeholders = torch.full((batch, tokens), config.image_token_id, dtype=torch.long)
    inputs["input_ids"] = torch.cat([inputs["input_ids"][:, :2], placeholders, inputs["input_ids"][:, 2:]], dim=1)
    inputs["attention_mask"] = torch.ones_like(inputs["input_ids"])
    patches = _IMAGE_GRID[0] * _IMAGE_GRID[1] * _IMAGE_GRID[2]
    inputs["pixel_values"] = request.randn(batch * patches, volume)
    inputs["image_grid_thw"] = torch.tensor([_IMAGE_GRID] * batch)
    if request.takes("mm_token_type_ids"):
        inputs["mm_token_type_ids"] = (inputs["input_ids"] == config.image_token_id).long()
    return inputs


def _takes_crop_images(request: InputRequest) -> bool:
    return {"image_pixel_values", "image_sizes", "image_attention_mask"} <= request.params and hasattr(
        getattr(request.config, "vision_config", None), "crop_size"
    )


def crop_tokens(config: PretrainedConfig) -> int:
    """Phi-4-multimodal, one crop-sized image: its single sub-crop then the global view, each
    2x2-pooled patch rows ending in a separator, with one separator between the two."""
    vision = config.vision_config
    side = (vision.image_size // vision.patch_size + 1) // 2  # odd grids are padded before pooling
    return 2 * side * (side + 1) + 1


def crop_image_inputs(request: InputRequest) -> dict[str, torch.Tensor]:
    """Phi-4-multimodal: per row the global view and one crop, ``(batch, crops, C, H, W)``, the
    image's size in crops (``image_sizes``) and which patches are image (all of them)."""
    config, batch = request.config, request.batch_size
    vision = config.vision_config
    count = crop_tokens(config)
    inputs = text_request_inputs(request)
    placeholders = torch.full((batch, count), vision.image_token_id, dtype=torch.long)
    inputs["input_ids"] = torch.cat([inputs["input_ids"][:, :2], placeholders, inputs["input_ids"][:, 2:]], dim=1)
    inputs["attention_mask"] = torch.ones_like(inputs["input_ids"])
    size, patches = vision.crop_size, vision.image_size // vision.patch_size
    inputs["image_pixel_values"] = request.randn(batch, 2, vision.num_channels, vision.image_size, vision.image_size)
    inputs["image_sizes"] = torch.tensor([[size, size]] * batch)
    inputs["image_attention_mask"] = torch.ones(batch, 2, patches, patches, dtype=torch.bool)
    return inputs


COMPOSITE_BUILDERS: list[tuple[Callable[[InputRequest], bool], Builder]] = [
    (_takes_query_tokens, query_token_inputs),
    (_takes_region_features, region_feature_inputs),
    (_takes_language_ids, language_adapter_inputs),
    (_takes_image_position_mask, image_position_inputs),
    (_takes_image_cross_attention, image_cross_attention_inputs),
    (_takes_query_embeds, query_embed_inputs),
    (_takes_codepoints, codepoint_inputs),
    (_takes_pooled_patches, pooled_patch_inputs),
    (_takes_protein, protein_text_inputs),
    (_takes_action_embeds, action_prefix_inputs),
    (_takes_draft_context, draft_block_inputs),
    (_takes_spliced_image, spliced_image_inputs),
    (_takes_packed_grid_image, packed_grid_image_inputs),
    (_takes_crop_images, crop_image_inputs),
    (takes_text_prompt, text_prompt_inputs),  # prompted segmentation / detection: prompts.py
    (takes_class_list, class_list_inputs),
    (takes_point_prompt, point_prompt_inputs),
]
