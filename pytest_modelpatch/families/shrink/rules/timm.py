"""Per-family config rules for families whose vision tower is a timm model.

Same contract as ``rules.CONFIG_RULES`` (which merges this table): keyed by
``model_type``, applied to the shrunk level after the generic rules and before overrides.

A timm tower's sizes are not config fields: ``TimmWrapperConfig`` names an ``architecture``
and passes ``model_args`` to ``timm.create_model``, so the generic rules, which shrink named
fields, leave a 23M-parameter ResNet-50 or a 300M MobileNetV5 untouched. These rules shrink
the same architecture through ``model_args`` (depths, widths, heads), so a patch of its block
classes still runs, and make the parent VLM's copies of the tower's sizes agree. None of them
imports timm at module level: where timm is absent the families fail at build as before and
every other family is unaffected.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator, Mapping
from typing import Any

ConfigRule = Mapping[str, Any] | Callable[[dict[str, Any]], None]

# Side of the tiny image a timm tower gets. TimmWrapperConfig has no image size, so it is
# stored as an extra ``image_size`` key: the example inputs read it, the model ignores it.
TINY_TIMM_IMAGE = 32

# --- ResNet (timm_wrapper's default, resnet50) ---------------------------------------------

# One block per stage at an eighth of the widths (Bottleneck's 4x expansion: 512 features)
TINY_RESNET_ARGS: dict[str, Any] = {"layers": [1, 1, 1, 1], "channels": [16, 32, 64, 128], "stem_width": 16}

# --- FastViT MCi (FastVLM's tower) ------------------------------------------------------------

# FastViT attention stages split their width into heads of 32 channels, so the two attention
# stages stay multiples of 32; one block per stage keeps every repmixer/attention stage and
# its patch-embedding downsample
TINY_FASTVIT_ARGS: dict[str, Any] = {"embed_dims": [16, 16, 32, 32, 64], "layers": [1, 1, 1, 1, 1]}
# The stem (stride 4) and four downsamples: 128 px leave a 2x2 grid, 4 image tokens
FASTVIT_MCI_STRIDE = 64
FASTVIT_MCI_IMAGE = 2 * FASTVIT_MCI_STRIDE

# --- Perception Encoder ViT (PerceptionLM's tower) --------------------------------------------

# PLM checkpoints build vit_pe_core_* without its attention-pool head (global_pool "") and
# without the last norm; 16-wide heads keep the 2-D rope's four quarter-sections non-empty
TINY_PE_ARGS: dict[str, Any] = {
    "embed_dim": 64,
    "depth": 2,
    "num_heads": 4,
    "global_pool": "",
    "use_post_transformer_norm": False,
}
PE_ARCHITECTURE = "vit_pe_core_large_patch14_336"  # Perception-LM-1B/3B/8B's tower
PE_PATCH = 14
PE_GRID = 4  # patches per side: 16 image tokens, which a pooling ratio of 2 or 4 divides

# --- MobileNetV5 (Gemma 3n's tower) -------------------------------------------------------------

# mobilenetv5_300m_enc's stage layout in timm's block notation, each block kind kept once or
# twice (edge residual, universal inverted residual, multi-query attention with and without
# key/value downsampling) at 16..64 channels; its arch_def is hard-coded, so the only way to
# shrink it is to pass block_args, which override it
TINY_MNV5_ARCH: list[list[str]] = [
    ["er_r1_k3_s2_e4_c16"],
    ["uir_r1_a3_k5_s2_e6_c16", "uir_r1_a5_k0_s1_e4_c16"],
    ["uir_r1_a5_k5_s2_e6_c32", "uir_r1_a0_k0_s1_e1_c32", "mqa_r1_k3_h2_v2_s1_d16_c32", "uir_r1_a0_k0_s1_e2_c32"],
    ["uir_r1_a5_k5_s2_e6_c64", "mqa_r1_k3_h2_s1_d16_c64", "uir_r1_a0_k0_s1_e2_c64"],
]
# The encoder's multi-scale fusion always outputs 2048 channels (hard-coded in timm), which
# Gemma 3n reads as vision_config.hidden_size; the generic width rule shrank it to 64
MNV5_FEATURES = 2048
# The fusion runs at stride 16: a 32-px image gives 2x2 soft tokens per image
MNV5_OUTPUT_SIDE = TINY_TIMM_IMAGE // 16

# --- timm_backbone ----------------------------------------------------------------------------

# TimmBackboneConfig has no default model (backbone None: the build refuses) and no
# model_args, so only a model name can make it small: timm's own test ResNet (same family
# as the resnet50 of its docstring), stages of 8..64 channels
TINY_TIMM_BACKBONE = "test_resnet"


class _StagesCopiedOnIteration(list):
    """Decoded block arguments that hand out copies when iterated.

    timm's EfficientNetBuilder builds each block by editing its argument dict in place (pops
    ``block_type``, adds layer classes and partials), and transformers passes the config's
    ``model_args`` to it as they are: plain lists would leave the config unserialisable (no
    save_pretrained) and unbuildable a second time. Indexing and JSON encoding still see the
    stored, pristine values; a config reloaded from JSON is built once and not saved again.
    """

    def __iter__(self) -> Iterator[Any]:
        return (copy.deepcopy(stage) for stage in super().__iter__())


def _decode_mnv5_blocks() -> list[list[dict[str, Any]]] | None:
    """timm's decoded block arguments (plain JSON values) for ``TINY_MNV5_ARCH``; ``None``
    without timm, where the tower cannot be built anyway."""
    try:
        from timm.models._efficientnet_builder import decode_arch_def
    except ImportError:
        return None
    return _StagesCopiedOnIteration(decode_arch_def(TINY_MNV5_ARCH))


def _with_args(level: dict[str, Any], args: Mapping[str, Any]) -> None:
    # the checkpoint's own model_args (FastVLM: inference_mode) stay, the tiny sizes win
    level["model_args"] = {**(level.get("model_args") or {}), **args}


def _timm_wrapper(level: dict[str, Any]) -> None:
    """Shrink a known timm architecture through its model_args; unknown ones are left alone."""
    # transformers 5.23's EdgeTAM default spells the key "archirecture", so the wrapper falls
    # back to its own default, a resnet50 (1024 channels at a neck built for RepViT's 384):
    # take the architecture the config meant before shrinking the wrong one
    misspelt = level.get("archirecture")
    if isinstance(misspelt, str) and level.get("architecture") in (None, "resnet50"):
        level["architecture"] = misspelt
    architecture = str(level.get("architecture") or "")
    if architecture.startswith("resnet") and not architecture.startswith("resnetv2"):
        _with_args(level, TINY_RESNET_ARGS)
        level.setdefault("image_size", TINY_TIMM_IMAGE)
    elif architecture.startswith("fastvit_mci"):
        _with_args(level, TINY_FASTVIT_ARGS)
        # the projector reads hidden_size: the last stage's width times the final conv's
        # cls_ratio of 2, which the config states as a plain number (3072)
        level["hidden_size"] = TINY_FASTVIT_ARGS["embed_dims"][-1] * 2
        level["image_size"] = FASTVIT_MCI_IMAGE
    elif architecture.startswith("vit_pe_core"):
        _pe_tower(level)
    elif architecture.startswith("mobilenetv5"):
        _mobilenet_v5(level)


def _pe_tower(level: dict[str, Any]) -> None:
    # the rope's reference grid and the patch grid of img_size must agree, or the rope
    # tables do not match the number of patches
    _with_args(level, {**TINY_PE_ARGS, "img_size": [PE_GRID * PE_PATCH] * 2, "ref_feat_shape": [PE_GRID] * 2})
    level["image_size"] = PE_GRID * PE_PATCH


def _mobilenet_v5(level: dict[str, Any]) -> None:
    blocks = _decode_mnv5_blocks()
    args: dict[str, Any] = {"stem_size": 16, "msfa_output_resolution": MNV5_OUTPUT_SIDE}
    if blocks is not None:
        args["block_args"] = blocks
    _with_args(level, args)
    level["hidden_size"] = MNV5_FEATURES
    level["image_size"] = TINY_TIMM_IMAGE


def _gemma3n(level: dict[str, Any]) -> None:
    # the soft tokens per image are the fusion's output grid, which the config repeats as a
    # plain number (256 = 16 x 16) and the model reshapes by
    vision = level.get("vision_config")
    if isinstance(vision, dict):
        side = (vision.get("model_args") or {}).get("msfa_output_resolution")
        if isinstance(side, int):
            level["vision_soft_tokens_per_image"] = side * side


def _perception_lm(level: dict[str, Any]) -> None:
    """PerceptionLM's default vision config is timm_wrapper's resnet50, which its projector
    cannot read (it takes ``model_args["embed_dim"]``): the default config cannot build. Its
    checkpoints use a Perception Encoder ViT; a tiny one of the same architecture here."""
    vision = level.get("vision_config")
    if not isinstance(vision, dict):
        return
    if not str(vision.get("architecture") or "").startswith("vit_pe_core"):
        vision["architecture"] = PE_ARCHITECTURE
        vision["model_args"] = None  # the ResNet's tiny args mean nothing to a ViT
        _pe_tower(vision)
    vision["do_pooling"] = False  # as in the checkpoints: the LM reads patch tokens, not a pooled one
    # the projector's optional pooling reshapes the patch tokens to a square grid and pools it
    # by this ratio, which must divide the tiny grid
    ratio = level.get("projector_pooling_ratio")
    if isinstance(ratio, int) and ratio > 1 and PE_GRID % ratio:
        level["projector_pooling_ratio"] = 2


TIMM_CONFIG_RULES: dict[str, ConfigRule] = {
    "timm_wrapper": _timm_wrapper,
    "gemma3n_vision": _timm_wrapper,  # a TimmWrapperConfig under another model_type
    "gemma3n": _gemma3n,
    "perception_lm": _perception_lm,
    "timm_backbone": {"backbone": TINY_TIMM_BACKBONE},
}
