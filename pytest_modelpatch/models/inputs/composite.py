"""Inputs for composite text models: image placeholders a Q-Former fills, side inputs a forward requires.

``composite_builder`` picks a builder before the main-input dispatch when the model is one
of these shapes: BLIP-2-style (``num_query_tokens`` placeholders spliced into the text and
filled from the image), or a text model whose forward needs more than ids (LXMERT's region
features, X-MOD's language ids, Kosmos-2's image positions, IDEFICS' per-image cross-attention,
CANINE's code points). It returns ``None`` for every other model.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from transformers import PretrainedConfig

from pytest_modelpatch.models.inputs.prompts import (
    class_list_inputs,
    point_prompt_inputs,
    takes_class_list,
    takes_point_prompt,
    takes_text_prompt,
    text_prompt_inputs,
)
from pytest_modelpatch.models.inputs.request import InputRequest
from pytest_modelpatch.models.inputs.text import text_inputs, text_request_inputs
from pytest_modelpatch.models.inputs.vision import pixel_values

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
    if request.takes("token_type_ids") and getattr(request.config, "type_vocab_size", 0):
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
    return "input_ids" in request.params and hasattr(config, "num_hash_buckets") and not getattr(config, "vocab_size", 0)


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


# LLaVA-style models whose image-feature count per image no config key states: model type ->
# placeholders per image, from the (shrunk) config.
IMAGE_TOKENS_PER_IMAGE: dict[str, Callable[[PretrainedConfig], int]] = {
    "cohere2_vision": lambda c: _patch_grid(c) // c.downsample_factor**2,  # pixel-shuffle projector
    "janus": _patch_grid,  # SigLIP patches, one token each
}


def _takes_spliced_image(request: InputRequest) -> bool:
    return request.config.model_type in IMAGE_TOKENS_PER_IMAGE and "pixel_values" in request.params


def spliced_image_inputs(request: InputRequest) -> dict[str, torch.Tensor]:
    """One image per row whose features replace as many image placeholders after two text tokens."""
    config, batch = request.config, request.batch_size
    count = IMAGE_TOKENS_PER_IMAGE[config.model_type](config)
    inputs = text_request_inputs(request)
    placeholders = torch.full((batch, count), config.image_token_id, dtype=torch.long)
    inputs["input_ids"] = torch.cat([inputs["input_ids"][:, :2], placeholders, inputs["input_ids"][:, 2:]], dim=1)
    inputs["attention_mask"] = torch.ones_like(inputs["input_ids"])
    inputs["pixel_values"] = pixel_values(config, batch, request.generator)
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
    (takes_text_prompt, text_prompt_inputs),  # prompted segmentation / detection: prompts.py
    (takes_class_list, class_list_inputs),
    (takes_point_prompt, point_prompt_inputs),
]
