"""The families whose tiny model does not run here, with where they stop and why.

The tables ``docs/families.md`` prints (``tests/families/test_every_family.py`` checks they are equal):
a family sweep (``@pytest.mark.model(families="all")``) skips these with the reason instead of
failing on them. The reasons were measured on the transformers version ``.ci/constraints.txt`` pins.
"""

from __future__ import annotations

# model type -> (the stage it stops at, why)
NOT_RUNNING: dict[str, tuple[str, str]] = {
    "apertus1p5": (
        "config",
        "new in transformers 5.24: its validator wants the audio token range (`audio_token_offset` 262344 plus the codebook) inside the text vocabulary, which no tiny vocabulary holds; it needs a family rule that moves the offsets",
    ),
    "bark": (
        "inputs",
        "`BarkModel` has no forward (it only generates), and it is the class the auto mappings pick",
    ),
    "dinat": (
        "build",
        "needs natten (neighborhood-attention kernels), which has no CPU build for this torch",
    ),
    "dory": (
        "config",
        'new in transformers 5.24: its config interleaves `"mlp"` blocks in `layer_types` and halves `num_hidden_layers` when it reads them back, which the tiny layer-count shrinking does not follow yet',
    ),
    "edgetam_video": (
        "forward",
        "the forward takes a stateful `inference_session` (video tracking), not tensors",
    ),
    "glm_image_vqmodel": (
        "inputs",
        "`GlmImageVQVAE` has no forward, only `encode`: nothing a forward check can compare",
    ),
    "higgs_audio_v2_tokenizer": (
        "class",
        "needs torchaudio, which has no release for the CPU build of torch 2.13 this project installs",
    ),
    "layoutlmv2": (
        "build",
        "needs detectron2 for its visual backbone, which is not on PyPI",
    ),
    "llama4": (
        "forward",
        "transformers 5.24's `Llama4ForConditionalGeneration.forward` reads `outputs.image_outputs`, which its text model's output (`MoeCausalLMOutputWithPast`) does not have: an `AttributeError` in transformers itself",
    ),
    "omniasr_audio": (
        "forward",
        "new in transformers 5.24: its feature encoder takes a mono waveform (1 channel) and the generic audio inputs give it 2",
    ),
    "omniasr_ctc": (
        "forward",
        "new in transformers 5.24: its feature encoder takes a mono waveform (1 channel) and the generic audio inputs give it 2",
    ),
    "sam2_video": (
        "forward",
        "the forward takes a stateful `inference_session` (video tracking), not tensors",
    ),
    "sam3_tracker_video": (
        "forward",
        "the forward takes a stateful `inference_session` (video tracking), not tensors",
    ),
    "sam3_video": (
        "forward",
        "the forward takes a stateful `inference_session` (video tracking), not tensors",
    ),
    "timm_backbone": (
        "build",
        "a timm model by definition, so it needs timm (below); and where timm imports, `TimmBackbone.from_pretrained` builds a new config whose `backbone` is the checkpoint's path, which transformers' validator refuses: no checkpoint round trip",
    ),
}

# model type -> (stage, why): these run where timm (and a torchvision built for the installed torch) imports
NEEDS_TIMM: dict[str, tuple[str, str]] = {
    "edgetam": (
        "build",
        "its backbone is a `TimmWrapperModel` (RepViT)",
    ),
    "edgetam_vision_model": (
        "build",
        "its backbone is a `TimmWrapperModel` (RepViT)",
    ),
    "fast_vlm": (
        "build",
        "its vision tower is a `TimmWrapperModel` (FastViT-MCi)",
    ),
    "gemma3n": (
        "build",
        "its vision tower is a `TimmWrapperModel` (MobileNetV5); its text model, `gemma3n_text`, runs without timm",
    ),
    "gemma3n_vision": (
        "build",
        "a `TimmWrapperModel` (MobileNetV5)",
    ),
    "pe_audio_video": (
        "build",
        "its video tower's frame encoder is a `TimmWrapperModel` (Perception Encoder ViT); the clip runs beside text and audio",
    ),
    "pe_audio_video_encoder": (
        "build",
        "its video tower's frame encoder is a `TimmWrapperModel` (Perception Encoder ViT)",
    ),
    "pe_video": (
        "build",
        "its frame encoder is a `TimmWrapperModel` (Perception Encoder ViT)",
    ),
    "pe_video_encoder": (
        "build",
        "its frame encoder is a `TimmWrapperModel` (Perception Encoder ViT)",
    ),
    "perception_lm": (
        "build",
        "its vision tower is a `TimmWrapperModel` (Perception Encoder ViT)",
    ),
    "timm_wrapper": (
        "build",
        "a timm model by definition",
    ),
}
