"""pytest-modelpatch: prove that a patched transformers model is still the model.

Importing this package imports neither torch nor transformers; each public name
is loaded from its module on first access.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# public name -> module that defines it
_EXPORTS: dict[str, str] = {
    "isolated_patch_state": "isolation.guard",
    "PatchStateSnapshot": "isolation.guard",
    "PatchRegistry": "isolation.registration",
    "validate_mapping": "isolation.registration",
    "assert_equivalent": "compare.equivalence",
    "check_equivalence": "compare.property_checks",
    "assert_generates_equivalent": "compare.decoding",
    "DecodingReport": "compare.decoding",
    "check_generation": "compare.decoding_properties",
    "assert_backward_equivalent": "compare.backward",
    "BackwardReport": "compare.backward",
    "assert_trains_equivalent": "compare.training_steps",
    "TrainingReport": "compare.training_steps",
    "check_module_equivalence": "compare.divergence",
    "first_divergence": "compare.divergence",
    "TolerancePolicy": "compare.tolerance",
    "sqnr_policy": "compare.tolerance",
    "oracle_policy": "compare.tolerance",
    "check_roundtrip": "roundtrip.check",
    "RoundtripReport": "roundtrip.check",
    "load_with_fusion": "roundtrip.check",
    "diff_checkpoints": "roundtrip.safetensors_diff",
    "check_reversible": "isolation.reversibility",
    "lint_patterns": "models.structure",
    "Finding": "lint.patterns",
    "meta_structures": "models.structure",
    "tiny_config": "families.catalog",
    "example_inputs": "families.inputs",
    "CheckpointError": "errors",
    "cached_checkpoint": "models.checkpoints",
    "load_pretrained": "models.checkpoints",
    "model_inputs": "families.strategies",
    "tiny_configs": "families.strategies",
    "ModelBuilder": "models.builder",
    "ModelRequest": "models.builder",
    "PatchNotAppliedError": "errors",
    "NotApplicableError": "errors",
    "patch_usage": "models.usage",
    "without_patches": "isolation.guard",
    "CheckRecord": "reporting.records",
    "GateVerdict": "reporting.gate",
    "Thresholds": "reporting.gate",
    "load_report": "reporting.report",
    "divergence_profile": "compare.divergence",
    "ModelPatchError": "errors",
    "PatchUsageError": "errors",
    "PatchLeakError": "errors",
    "ModelPatchWarning": "errors",
    "ReportFileError": "errors",
    "ReferenceNotPristineError": "errors",
    "pristine": "isolation.pristine",
    "ScanIndexError": "errors",
    "assert_exports_equivalent": "compare.graph.export",
    "assert_compiles_equivalent": "compare.graph.compile",
    "ParityReport": "compare.graph.parity",
    "ExportReport": "compare.graph.export",
    "CompileReport": "compare.graph.compile",
}

__all__ = sorted(_EXPORTS) + ["__version__"]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'pytest_modelpatch' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
