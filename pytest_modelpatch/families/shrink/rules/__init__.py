"""Per-family rules for what the generic shrinking in ``configs.py`` cannot derive.

Keyed by ``model_type``; a rule applies to every config level of that type (a top-level
config or a sub-config), after generic shrinking and before the user's overrides, which
always win. A rule is either a dict of values to set or a function that edits the shrunk
level in place. Each entry says why the generic rules are not enough; prefer teaching
``configs.py`` a general rule over adding an entry here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from pytest_modelpatch.families.shrink.rules.documents import DOCUMENT_CONFIG_RULES
from pytest_modelpatch.families.shrink.rules.text import TEXT_CONFIG_RULES
from pytest_modelpatch.families.shrink.rules.timm import TIMM_CONFIG_RULES, TINY_PE_ARGS
from pytest_modelpatch.families.shrink.sizes import TINY_IMAGE

ConfigRule = Mapping[str, Any] | Callable[[dict[str, Any]], None]

TINY_TIME_FEATURES = 2  # time features (e.g. day of week, hour) per step of a forecaster


def _x4_feature_from_backbone(level: dict[str, Any]) -> None:
    # PP-DocLayoutV3's mask branch reads the backbone's first stage (stride 4) at
    # ``x4_feat_dim``, a number the config repeats instead of deriving
    stages = (level.get("backbone_config") or {}).get("stage_out_channels")
    if isinstance(stages, list) and stages:
        level["x4_feat_dim"] = stages[0]


def _efficientloftr(level: dict[str, Any]) -> None:
    level.update(out_features=[16, 16, 32, 64], stage_num_blocks=[1, 1, 2, 2], num_attention_heads=8)
    # to_dict() carries the per-block channel lists the config derives from out_features;
    # dropped, so the config derives them again from the tiny values
    for key in (
        "stage_in_channels",
        "stage_block_stride",
        "stage_block_out_channels",
        "stage_block_in_channels",
        "fine_fusion_dims",
        "intermediate_size",
        "num_key_value_heads",
    ):
        level.pop(key, None)


def _sam_sizes(level: dict[str, Any]) -> None:
    # SAM's three sub-configs repeat each other's sizes instead of deriving them: the
    # vision neck's output_channels and positional features feed the prompt encoder and
    # the mask decoder, whose image embedding grid is image_size // patch_size
    vision, prompt = level.get("vision_config"), level.get("prompt_encoder_config")
    decoder = level.get("mask_decoder_config")
    if not (isinstance(vision, dict) and isinstance(prompt, dict) and isinstance(decoder, dict)):
        return
    width = decoder["hidden_size"]
    vision.update(output_channels=width, num_pos_feats=width // 2)
    prompt.update(hidden_size=width, image_embedding_size=vision["image_size"] // vision["patch_size"])
    decoder["iou_head_hidden_dim"] = width
    if "vit_dim" in decoder:  # SAM-HQ reads the ViT's early features
        decoder["vit_dim"] = vision["hidden_size"]


def _hiera_det(level: dict[str, Any]) -> None:
    # SAM 2's Hiera backbone: the patch embedding is hidden_size wide and feeds the first
    # stage; global_attention_blocks index blocks across all stages
    level["embed_dim_per_stage"] = [24, 48, 96, 192]  # a quarter of the default, heads [1, 2, 4, 8] still divide
    level["hidden_size"] = 24
    level["blocks_per_stage"] = [1, 1, 2, 1]
    level["global_attention_blocks"] = [3]  # not a stage's first block, which pools with its window


def _hiera_neck(level: dict[str, Any]) -> None:
    # the FPN neck lists the backbone's stage widths, widest first
    backbone = level.get("backbone_config")
    if isinstance(backbone, dict) and isinstance(backbone.get("embed_dim_per_stage"), list):
        level["backbone_channel_list"] = list(reversed(backbone["embed_dim_per_stage"]))
        # and the grids of the three finest stages: image / 4, / 8, / 16
        image = backbone.get("image_size") or [1024, 1024]
        side = (image if isinstance(image, int) else image[0]) // 4
        level["backbone_feature_sizes"] = [[side >> i, side >> i] for i in range(3)]


def _sam2_prompt_grid(level: dict[str, Any]) -> None:
    # SAM 2 / SAM 3 tracker: the prompt encoder's dense embedding is image_size // patch_size
    # wide and is added to the vision neck's coarsest map (backbone_feature_sizes[-1]); the
    # config states both instead of deriving one (1024 // 16 == 64 by default)
    vision, prompt = level.get("vision_config"), level.get("prompt_encoder_config")
    if not (isinstance(vision, dict) and isinstance(prompt, dict)):
        return
    sizes = vision.get("backbone_feature_sizes")
    if isinstance(sizes, list) and sizes and isinstance(prompt.get("image_size"), int):
        prompt["patch_size"] = prompt["image_size"] // sizes[-1][0]


# RepViT-M1's stage widths (48, 96, 192, 384) and depths (2, 2, 14, 2) divided down: widths
# doubling per stage as in M1, two blocks per stage so both the squeeze-excite and the plain
# RepViT block run (a stage alternates them); 0.3M parameters instead of 4.7M
EDGETAM_REPVIT_ARGS: dict[str, list[int]] = {"embed_dim": [16, 32, 64, 128], "depth": [2, 2, 2, 2]}


def _feature_sizes(image: int) -> list[list[int]]:
    """The grids of a backbone's three finest stages, at strides 4, 8 and 16."""
    return [[image // 4 >> i] * 2 for i in range(3)]


def _edgetam_neck(level: dict[str, Any]) -> None:
    # EdgeTAM's backbone is a timm RepViT behind a timm_wrapper sub-config: its stage widths
    # live in model_args (passed to timm.create_model), which generic shrinking does not
    # enter, while the FPN neck repeats them, widest first, in backbone_channel_list
    # (the timm_wrapper rule, run on the sub-config first, restored its misspelt architecture)
    backbone = level.get("backbone_config")
    if not isinstance(backbone, dict) or not str(backbone.get("architecture")).startswith("repvit"):
        return  # another timm model: its own kwargs, which this rule does not know
    args = dict(backbone.get("model_args") or {})
    args.update({key: list(value) for key, value in EDGETAM_REPVIT_ARGS.items()})
    backbone["model_args"] = args
    level["backbone_channel_list"] = list(reversed(args["embed_dim"]))
    # the model reshapes the three finest maps to these grids (listed for a 1024-px image)
    level["backbone_feature_sizes"] = _feature_sizes(TINY_IMAGE)


def _edgetam_prompt_grid(level: dict[str, Any]) -> None:
    # EdgeTAM is SAM 2 on a RepViT: the neck's grids follow the prompt encoder's image size
    # (the input the model is fed), then the prompt grid follows the coarsest of them
    vision, prompt = level.get("vision_config"), level.get("prompt_encoder_config")
    if isinstance(vision, dict) and isinstance(prompt, dict) and isinstance(prompt.get("image_size"), int):
        if isinstance(vision.get("backbone_feature_sizes"), list):
            vision["backbone_feature_sizes"] = _feature_sizes(prompt["image_size"])
    _sam2_prompt_grid(level)


def _sam3_feature_sizes(level: dict[str, Any]) -> None:
    # SAM 3's FPN rescales the ViT's patch grid by scale_factors (x4, x2, x1, x0.5) and the
    # model reshapes its first three maps to backbone_feature_sizes, which the config lists
    # for the full 1008 / 14 = 72 grid instead of deriving them
    backbone = level.get("backbone_config")
    scales = level.get("scale_factors")
    if not (isinstance(backbone, dict) and isinstance(scales, list)):
        return
    image, patch = backbone.get("image_size"), backbone.get("patch_size")
    if isinstance(image, int) and isinstance(patch, int):
        grid = image // patch
        level["backbone_feature_sizes"] = [[int(grid * s)] * 2 for s in scales[:3]]


def _sam3_vit_windows(level: dict[str, Any]) -> None:
    # SAM 3's ViT attends in 24x24 windows (the 336 / 14 pretraining grid) except in the
    # global_attn_indexes layers; the tiny 4x4 grid fits in one window and every layer index
    # is global after shrinking, so windowed attention would never run. Windows of half the
    # grid, and only the last layer global, exercise both
    image, patch, layers = level.get("image_size"), level.get("patch_size"), level.get("num_hidden_layers")
    if isinstance(image, int) and isinstance(patch, int) and isinstance(layers, int) and layers > 1:
        level["window_size"] = max(1, image // patch // 2)
        level["global_attn_indexes"] = [layers - 1]


def _omdet_turbo(level: dict[str, Any]) -> None:
    # OmDet-Turbo's widths are plain numbers under names of their own that repeat other
    # levels' sizes: class and task embeddings are the CLIP text width (class_embed_dim,
    # the text projection's in and out), the encoder's feature maps and the decoder (its
    # deformable attention reads d_model) are d_model wide; the decoder always projects
    # task embeddings to its own width, so d_model must differ from the text width
    text_width = (level.get("text_config") or {}).get("hidden_size", 64)
    width = text_width // 2
    level.update(
        d_model=width,
        decoder_hidden_dim=width,
        decoder_num_heads=4,
        decoder_dim_feedforward=2 * width,
        encoder_dim_feedforward=2 * width,
        task_encoder_hidden_dim=2 * width,
        class_embed_dim=text_width,
        text_projection_in_dim=text_width,
        text_projection_out_dim=text_width,
        vision_features_channels=[width] * len(level.get("vision_features_channels") or [0, 0, 0]),
        # the layer norms turn timm Swin's channels-last maps into channels-first ones; the
        # tiny transformers backbone that replaces timm already returns channels-first maps
        apply_layernorm_after_vision_backbone=False,
    )


def _lw_detr_projector(level: dict[str, Any]) -> None:
    # LW-DETR's default config lists no projector scales (every checkpoint sets its own), so
    # the decoder has zero feature levels and cannot run; two scales (x2 and x0.5, as the
    # large checkpoints use) exercise the multi-level deformable attention. The sizes the
    # config derives from the scales in __post_init__ are stored too, and an explicit
    # value wins over the derivation, so they are set here
    scales = [2.0, 0.5]
    width = level.get("d_model", 64)
    level.update(
        projector_scale_factors=scales,
        num_feature_levels=len(scales),
        projector_in_channels=[width] * len(scales),
        projector_out_channels=width,
    )


def _fused_semantic_width(key: str, width_of: str) -> Callable[[dict[str, Any]], None]:
    """X-Codec style: ``key`` is the width of the semantic and acoustic features concatenated.

    The config stores it as a plain number (1024 + 1024 = 2048 in X-Codec 2), so generic
    shrinking cannot see that it is a sum of two sub-config widths.
    """

    def rule(level: dict[str, Any]) -> None:
        acoustic = level.get(width_of) if width_of != "hidden_size" else level
        semantic = level.get("semantic_model_config") or {}
        if isinstance(acoustic, dict) and "hidden_size" in acoustic and "hidden_size" in semantic:
            level[key] = acoustic["hidden_size"] + semantic["hidden_size"]

    return rule


def _dia_cross_attention(level: dict[str, Any]) -> None:
    """Dia's decoder cross-attends with sizes of the encoder, stored under ``cross_*`` names."""
    encoder, decoder = level.get("encoder_config"), level.get("decoder_config")
    if isinstance(encoder, dict) and isinstance(decoder, dict):
        decoder["cross_hidden_size"] = encoder["hidden_size"]
        decoder["cross_num_attention_heads"] = decoder["cross_num_key_value_heads"] = encoder["num_attention_heads"]
        decoder["cross_head_dim"] = encoder["head_dim"]


def _tvp(level: dict[str, Any]) -> None:
    # Frames of the generic tiny size (32) leave TVP's 32x-downsampling ResNet a 1x1 map,
    # which its grid encoder then max-pools by 2 to nothing. Its default ResNet-50 stages
    # (256..2048 channels) alone are 15M parameters; the grid encoder reads the last one.
    level["max_img_size"] = 64
    backbone = level.get("backbone_config")
    if isinstance(backbone, dict):
        backbone["hidden_sizes"] = [32, 64, 96, 128]
        backbone["embedding_size"] = 32


def _bros(level: dict[str, Any]) -> None:
    # BrosConfig.__post_init__ derives its box-embedding sizes from hidden_size and the
    # heads, but to_dict() saves the full model's values and from_dict() lets them win.
    for key in ("dim_bbox_sinusoid_emb_2d", "dim_bbox_sinusoid_emb_1d", "dim_bbox_projection"):
        level.pop(key, None)


def _align(level: dict[str, Any]) -> None:
    # ALIGN compares text embeddings projected to projection_dim with the EfficientNet's
    # pooled channels, round_filters(out_channels[-1]), unprojected: the two must agree.
    # A narrower, shallower EfficientNet keeps the tower under the parameter budget.
    vision = level.get("vision_config")
    if not isinstance(vision, dict):
        return
    vision.update(width_coefficient=0.5, depth_coefficient=0.25)  # one block per stage
    channels = vision["out_channels"][-1] * vision["width_coefficient"]
    divisor = vision["depth_divisor"]
    pooled = max(divisor, int(channels + divisor / 2) // divisor * divisor)
    level["projection_dim"] = pooled + divisor if pooled < 0.9 * channels else pooled


def _time_features(level: dict[str, Any]) -> None:
    # GluonTS-style forecasters take no time features by default (num_time_features = 0), so
    # the covariate columns of their value embedding never ran and a patch dropping them passed.
    # feature_size is derived from it once, at construction: moved by the same amount.
    added = TINY_TIME_FEATURES - level.get("num_time_features", 0)
    level["num_time_features"] = TINY_TIME_FEATURES
    if "feature_size" in level:
        level["feature_size"] += added


def _muse_spark_adapter_width(level: dict[str, Any]) -> None:
    # Muse Spark's vision tower pixel-shuffles merge_size**2 patches into one token, so its
    # adapter reads vision hidden_size * merge_size**2 (out_hidden_size, 6144 = 1536 * 4):
    # a number the config repeats, which the width rule shrank to the plain tiny width
    vision = level.get("vision_config")
    if isinstance(vision, dict) and "merge_size" in vision:
        level["out_hidden_size"] = vision["hidden_size"] * vision["merge_size"] ** 2


def _llama4_shuffled_width(level: dict[str, Any]) -> None:
    # Llama 4's pixel-shuffle adapter folds ratio**-2 patches into one token whose width its
    # fc1 reads as intermediate_size (5632 = 1408 * 4 in Scout): shrunk alone, the two disagree
    ratio = level.get("pixel_shuffle_ratio")
    if ratio and "hidden_size" in level:
        level["intermediate_size"] = int(level["hidden_size"] / ratio**2)


def _pinpoints_in_tiles(level: dict[str, Any]) -> None:
    # LLaVA-NeXT-style anyres: each pinpoint must be whole tiles of the vision tower's
    # image_size (336-px multiples by default); at a 32-px tower they are kept as the same
    # tile layouts ([1, 2], [2, 1], [2, 2], ...), 32 px a tile
    pinpoints, vision = level.get("image_grid_pinpoints"), level.get("vision_config")
    if not (pinpoints and isinstance(vision, dict) and isinstance(vision.get("image_size"), int)):
        return
    tile = min(min(point) for point in pinpoints)
    level["image_grid_pinpoints"] = [[side // tile * vision["image_size"] for side in point] for point in pinpoints]


# PE-Video's frame encoder: timm ``vit_pe_core_large_patch14_336`` (24 blocks x 1024 wide,
# 300M parameters, 336-px frames). A ``timm_wrapper`` config has no sizes of its own to
# shrink: timm.create_model takes them as ``model_args``. 2 blocks x 32 wide (2 heads of 16,
# enough for the 2-D rope's 4 frequency bands), the attention pool 2 heads too, and 16-px
# frames in 8-px patches: a 2x2 patch grid per frame.
TINY_PE_FRAME_ENCODER: dict[str, Any] = {
    "embed_dim": 32,
    "depth": 2,
    "num_heads": 2,
    "attn_pool_num_heads": 2,
    "patch_size": 8,
    "img_size": 16,
}


# what the timm_wrapper rule gives a vit_pe_core tower (rules.timm._pe_tower)
_TIMM_PE_KEYS = frozenset(TINY_PE_ARGS) | {"img_size", "ref_feat_shape"}


def _pe_video_frame_encoder(level: dict[str, Any]) -> None:
    # keyed by pe_video_encoder: the parent is what knows its vision_config is a frame encoder,
    # which keeps its attention pool (the timm_wrapper rule's PerceptionLM-style tower drops
    # it) and whose frame size the clip follows; a user's overrides come after and still win
    vision = level.get("vision_config")
    if isinstance(vision, dict) and vision.get("model_type") == "timm_wrapper":
        args = {k: v for k, v in (vision.get("model_args") or {}).items() if k not in _TIMM_PE_KEYS}
        vision["model_args"] = {**args, **TINY_PE_FRAME_ENCODER}
        vision["image_size"] = TINY_PE_FRAME_ENCODER["img_size"]


def _pe_audio_video_no_frame_rope(level: dict[str, Any]) -> None:
    # PeAudioVideoModel (transformers 5.23) ties the joint encoder's copy of the video tower to
    # video_model's, excluding only the ViT's ``rope.pos_embed`` buffer from the tie; timm
    # 1.0.31's rope also keeps a ``rope.bands`` buffer, which from_pretrained then looks up as
    # a tied *parameter* and fails ("`bands` is not an nn.Parameter"). Without the rope the
    # frame ViT has neither (learned absolute positions instead), so a saved tiny model loads.
    video = (level.get("audio_video_config") or {}).get("video_config")
    vision = video.get("vision_config") if isinstance(video, dict) else None
    if isinstance(vision, dict) and vision.get("model_type") == "timm_wrapper":
        vision["model_args"] = {**(vision.get("model_args") or {}), "use_rot_pos_emb": False}


CONFIG_RULES: dict[str, ConfigRule] = {
    "tvp": _tvp,
    "bros": _bros,
    "align": _align,
    # LiLT concatenates six layout embeddings of hidden_size // 6 back into hidden_size:
    # the width must divide by 6 (and by 4 heads and the channel_shrink_ratio of 4).
    "lilt": {"hidden_size": 48},
    # BiT's group norms use 32 groups; the tiny first stage's bottleneck has 8 channels
    "bit": {"num_groups": 8},
    # CvT indexes each stage's per-layer drop-path rates by the *stage* index
    # (transformers 5.x), so stage i needs more than i layers
    "cvt": {"depth": [1, 2, 3]},
    # pixel-decoder width; the generic rules do not touch ``feature_size`` (time-series
    # configs derive it from their inputs)
    "mask2former": {"feature_size": 64},
    "pp_doclayout_v3": _x4_feature_from_backbone,
    # EfficientNet scales its stage widths by width_coefficient (2.0: B7) and its last
    # conv to round_filters(1280); hidden_dim must equal that conv's width
    "efficientnet": {"width_coefficient": 0.25, "depth_coefficient": 0.5, "hidden_dim": 320},
    # the validator wants hidden_size == out_features[-1] (stage widths, not names); its 2-D
    # rope fills hidden_size // 4 frequencies per axis from head_dim * partial_rotary_factor
    # (4.0) // 2, which agree only with 8 heads
    "efficientloftr": _efficientloftr,
    # the validator wants (image_size / num_windows) % sqrt(num_windows) == 0; of the default
    # windowed blocks [0, 1, 3, 6, 7, 9] both tiny layers would be windowed: keep one global
    "lw_detr_vit": {"num_windows": 4, "window_block_indices": [0]},
    # LeViT's patch embedding is four fixed stride-2 convs: the attention-bias grid is
    # image_size // 16 whatever patch_size says, so patch_size must stay 16
    "levit": {"patch_size": 16},
    # the last stage unfolds 2x2 patches at output stride 32: the image must be 64 wide
    "sam": _sam_sizes,
    "sam_hq": _sam_sizes,
    "sam2_hiera_det_model": _hiera_det,
    "sam2_vision_model": _hiera_neck,
    "lw_detr": _lw_detr_projector,
    "omdet-turbo": _omdet_turbo,
    "sam2": _sam2_prompt_grid,
    "sam3_tracker": _sam2_prompt_grid,
    "sam3_vision_model": _sam3_feature_sizes,
    "sam3_vit_model": _sam3_vit_windows,
    "edgetam_vision_model": _edgetam_neck,
    "edgetam": _edgetam_prompt_grid,
    # SegGPT's image is the prompt stacked above the query (896 x 448 by default, 2:1);
    # its decoder reads these layers' hidden states, which must come after the merge layer
    "seggpt": {"image_size": [64, 32], "intermediate_hidden_state_indices": [1], "merge_index": 0},
    # OneFormer's task prompt: 77 tokens of a CLIP-size vocabulary by default. hidden_dim ==
    # conv_dim as in the released checkpoints: otherwise the transformer module projects with
    # Conv2d layers it keeps in a plain list, unregistered, so from_pretrained leaves them on
    # the meta device and every forward reads uninitialised memory
    "oneformer": {
        "task_seq_len": 8,
        "text_encoder_context_length": 8,
        "text_encoder_vocab_size": 256,
        "text_encoder_width": 64,
        "conv_dim": 64,
        "mask_dim": 64,
        "hidden_dim": 64,
    },
    "mobilevitv2": {"image_size": 64, "width_multiplier": 0.5},
    "time_series_transformer": _time_features,
    "informer": _time_features,
    "autoformer": _time_features,
    # X-Codec: codebook_dim == acoustic (DAC) width + semantic (HuBERT) width
    "xcodec": _fused_semantic_width("codebook_dim", "acoustic_model_config"),
    # X-Codec 2 / NeuCodec: the quantizer projects the concatenated features, hidden_size + semantic width
    "xcodec2": _fused_semantic_width("quantization_dim", "hidden_size"),
    "neucodec": _fused_semantic_width("quantization_dim", "hidden_size"),
    # per-stage widths under a name (hidden_sizes) generic shrinking leaves to vision backbones;
    # 256..2048 channels make 100M parameters. Doubling per stage, ending at the tiny width.
    "muse_spark_audio": {"hidden_sizes": [8, 16, 32, 64]},
    "muse_spark": _muse_spark_adapter_width,
    "llama4_vision_model": _llama4_shuffled_width,
    # The forward samples with torch.randn scaled by these (a VAE latent, VITS' flow and
    # duration noise), so two runs of the same weights differ; at zero they agree and every
    # layer still runs.
    "vibevoice_acoustic_tokenizer": {"vae_std": 0.0},
    # VibeVoice-ASR draws its latent noise from its acoustic encoder's config (a level of this
    # type), once its example inputs carry audio
    "vibevoice_acoustic_tokenizer_encoder": {"vae_std": 0.0},
    # (VITS: its layer counts have names of their own, 16 posterior WaveNet layers)
    "vits": {"noise_scale": 0.0, "noise_scale_duration": 0.0, "posterior_encoder_num_wavenet_layers": 2},
    # Qwen3-ASR's conv stem widths and output projection have names of their own
    # (downsample_hidden_size 480: 4M of conv weights; output_dim: the LM width it feeds)
    "qwen3_asr_encoder": {"downsample_hidden_size": 32, "output_dim": 64},
    "dia": _dia_cross_attention,
    # CLVP's rotary dimension is max(projection_dim // (2 * heads), 32): heads must be 32 wide
    "clvp_encoder": {"num_attention_heads": 2},
    # CLAP's Swin audio tower ends at patch_embeds_hidden_size * 2**(stages - 1), which the
    # projection reads as hidden_size (96 * 8 = 768 in the full config)
    "clap_audio_model": {"patch_embeds_hidden_size": 8},
    # AST: 1024 frames x 128 mel bins is 1212 patches; 64 x 32 with its 10-step stride is 10
    "audio-spectrogram-transformer": {"max_length": 64, "num_mel_bins": 32},
    # Perceiver's latent array has sizes of its own: 256 latents x 1280 wide, 26 self-attention
    # layers per block (260M parameters); heads must divide both d_latents and d_model
    "perceiver": {
        "num_latents": 16,
        "d_latents": 64,
        "num_self_attends_per_block": 2,
        "num_self_attention_heads": 4,
        "num_cross_attention_heads": 4,
    },
    # transformers 5.23: the decoder layer reads config.num_key_value_heads, which
    # MoonshineStreamingConfig does not define, so even the default config cannot build;
    # set to the head count: plain multi-head attention
    "moonshine_streaming": {"num_key_value_heads": 4},
    # Nemotron ASR (streaming, and the encoder of 3.5 ASR): a chunk is lookahead + 1 frames; 13 makes
    # 14-frame chunks, longer than the 9 frames tiny audio yields, so the chunked mask masked nothing
    # (and transformers 5.24's eager path, which masks the keys the mask allows, gave all -inf rows:
    # NaN). 1 makes 2-frame chunks with one chunk of left context, so each row masks some keys, as
    # a long utterance's rows do (docs/families.md, known differences)
    "nemotron_asr_streaming_encoder": {"default_num_lookahead_tokens": 1},
    # kernel predictor: hidden x hidden x kernel weights per resblock layer (14.8M at 32/64)
    "univnet": {"model_hidden_channels": 8, "kernel_predictor_hidden_channels": 16, "model_in_channels": 16},
    # PE-Video (alone or inside PE-Audio-Video): shrink the timm ViT that embeds each frame
    "pe_video_encoder": _pe_video_frame_encoder,
    "pe_audio_video": _pe_audio_video_no_frame_rope,
}


# the text, hybrid and composite families' rules live in their own module
CONFIG_RULES.update(TEXT_CONFIG_RULES)
# OCR, document and dense-prediction families
CONFIG_RULES.update(DOCUMENT_CONFIG_RULES)
# families whose vision tower is a timm model, sized through model_args
CONFIG_RULES.update(TIMM_CONFIG_RULES)


def _both(first: ConfigRule, second: ConfigRule) -> ConfigRule:
    """A rule applying ``first`` then ``second`` (a family with rules in both modules)."""

    def rule(level: dict[str, Any]) -> None:
        for part in (first, second):
            part(level) if callable(part) else level.update(part)

    return rule


# Granite 4 Vision's deep-stack sizes are in the text module; its anyres tiles are a vision rule
CONFIG_RULES["granite4_vision"] = _both(TEXT_CONFIG_RULES["granite4_vision"], _pinpoints_in_tiles)


def apply_config_rule(model_type: Any, level: dict[str, Any]) -> None:
    """Apply the rule for ``model_type`` (if any) to one shrunk config level, in place."""
    rule = CONFIG_RULES.get(model_type) if isinstance(model_type, str) else None
    if rule is None:
        return
    if callable(rule):
        rule(level)
    else:
        level.update(rule)
