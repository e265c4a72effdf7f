"""pytest-modelpatch: prove that a patched transformers model is still the model.

Importing this package imports neither torch nor transformers; each public name
is loaded from its module on first access.
"""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

__version__ = "0.1.0"

# public name -> module that defines it, grouped by room (docs/architecture.md). The naming rule
# (docs/reference.md): assert_* runs one comparison and raises; check_* runs it over drawn inputs.
_EXPORTS: dict[str, str] = {
    # errors.py: every exception and warning
    "ModelPatchError": "errors",
    "PatchUsageError": "errors",
    "PatchLeakError": "errors",
    "PatchNotAppliedError": "errors",
    "ReferenceNotPristineError": "errors",
    "CheckpointError": "errors",
    "ScanIndexError": "errors",
    "ReportFileError": "errors",
    "ReportMergeError": "errors",
    "ModelMismatchError": "errors",
    "RankPoolError": "errors",
    "NotApplicableError": "errors",
    "ModelPatchWarning": "errors",
    "ModelPatchDeprecationWarning": "errors",
    # lint/: the lint's findings (the function that builds tiny models to judge them is in models/)
    "Finding": "lint.findings",
    "failing_findings": "lint.patterns",
    # reporting/: the records every check writes, the report and the gate
    "CheckRecord": "reporting.records",
    "load_report": "reporting.report",
    "GateVerdict": "reporting.gate",
    "Thresholds": "reporting.gate",
    # families/: tiny configs and inputs for every family, and their hypothesis strategies
    "tiny_config": "families.catalog",
    "example_inputs": "families.inputs",
    "tiny_configs": "families.strategies",
    "model_inputs": "families.strategies",
    # isolation/: the global patch state, registered and restored
    "isolated_patch_state": "isolation.guard",
    "PatchStateSnapshot": "isolation.guard",
    "pristine": "isolation.pristine",
    "PatchRegistry": "isolation.registration",
    "validate_mapping": "isolation.registration",
    "assert_reversible": "isolation.reversibility",
    "reversibility_problems": "isolation.reversibility",
    "ReversibilityProblem": "isolation.reversibility",
    # models/: checkpoints, the reference/patched builder, devices, the lint with tiny models
    "cached_checkpoint": "models.checkpoints",
    "load_pretrained": "models.checkpoints",
    "seeded_model": "models.checkpoints",
    "ModelBuilder": "models.builder",
    "ModelRequest": "models.builder",
    "patch_usage": "models.usage",
    "lint_patterns": "models.structure",
    "meta_structures": "models.structure",
    "select_device": "models.devices",
    "CudaStatus": "models.devices",
    "xdist_worker_index": "models.devices",
    # compare/: the checks (assert_* one comparison, check_* over drawn inputs), their reports, tolerances
    "assert_equivalent": "compare.forward.equivalence",
    "EquivalenceReport": "compare.forward.equivalence",
    "check_equivalent": "compare.forward.properties",
    "check_backward_equivalent": "compare.forward.properties",
    "PropertyReport": "compare.forward.properties",
    "assert_backward_equivalent": "compare.backward.equivalence",
    "BackwardReport": "compare.backward.equivalence",
    "assert_generates_equivalent": "compare.decoding.equivalence",
    "DecodingReport": "compare.decoding.equivalence",
    "check_generates_equivalent": "compare.decoding.properties",
    "GenerationPropertyReport": "compare.decoding.properties",
    "assert_trains_equivalent": "compare.training.steps",
    "TrainingReport": "compare.training.steps",
    "assert_module_equivalent": "compare._engine.divergence",
    "ModuleEquivalenceReport": "compare._engine.divergence",
    "first_divergence": "compare._engine.divergence",
    "divergence_profile": "compare._engine.divergence",
    "Divergence": "compare._engine.divergence",
    "assert_exports_equivalent": "compare.graph.export",
    "ExportReport": "compare.graph.export",
    "assert_compiles_equivalent": "compare.graph.compile",
    "CompileReport": "compare.graph.compile",
    "ParityReport": "compare.graph.parity",
    "TolerancePolicy": "compare._engine.tolerance",
    "DtypeTolerance": "compare._engine.tolerance",
    "ToleranceSpec": "compare._engine.tolerance",
    "resolve_tolerance": "compare._engine.tolerance",
    "sqnr_policy": "compare._engine.tolerance",
    "oracle_policy": "compare._engine.tolerance",
    "DEFAULT_POLICY": "compare._engine.tolerance",
    "LOOSE_POLICY": "compare._engine.tolerance",
    "STRICT_POLICY": "compare._engine.tolerance",
    # roundtrip/: lossless save and load
    "assert_roundtrip": "roundtrip.check",
    "RoundtripReport": "roundtrip.check",
    "load_with_fusion": "roundtrip.check",
    "diff_checkpoints": "roundtrip.safetensors_diff",
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


# ---------------------------------------------------------------------------
# Names the naming rule renamed (docs/reference.md), kept one release: each warns
# (ModelPatchDeprecationWarning) on every call, then calls its new name with the old keywords mapped.
# None is in __all__.
# ---------------------------------------------------------------------------

_REMOVED_IN = "0.3"


def _warn(old: str, new: str, how: str = "", stacklevel: int = 3) -> None:
    from pytest_modelpatch.errors import ModelPatchDeprecationWarning

    warnings.warn(
        f"pytest_modelpatch.{old} is now {new}{how}; the old name goes in {_REMOVED_IN}.",
        ModelPatchDeprecationWarning,
        stacklevel=stacklevel,  # the caller's line
    )


def check_equivalence(reference: Any, patched: Any, *, backward: bool = False, **options: Any) -> Any:
    """Renamed: ``check_equivalent``, and ``check_backward_equivalent`` for ``backward=True``."""
    __tracebackhide__ = True
    new = "check_backward_equivalent" if backward else "check_equivalent"
    _warn("check_equivalence", new, " (backward=True is check_backward_equivalent)" if backward else "")
    return __getattr__(new)(reference, patched, **options)


def check_generation(reference: Any, patched: Any, *, max_prompt_len: int | None = None, **options: Any) -> Any:
    """Renamed: ``check_generates_equivalent``, whose ``max_seq_len`` was ``max_prompt_len``."""
    __tracebackhide__ = True
    _warn(
        "check_generation", "check_generates_equivalent", " (max_prompt_len= is max_seq_len=)" if max_prompt_len else ""
    )
    if max_prompt_len is not None:
        options["max_seq_len"] = max_prompt_len
    return __getattr__("check_generates_equivalent")(reference, patched, **options)


def check_module_equivalence(original_module: Any, patched_module: Any = None, **options: Any) -> Any:
    """Renamed: ``assert_module_equivalent``, whose first argument is ``reference_module``."""
    __tracebackhide__ = True
    _warn("check_module_equivalence", "assert_module_equivalent")
    return __getattr__("assert_module_equivalent")(original_module, patched_module, **options)


def check_roundtrip(source: Any, **options: Any) -> Any:
    """Renamed: ``assert_roundtrip``."""
    __tracebackhide__ = True
    _warn("check_roundtrip", "assert_roundtrip")
    return __getattr__("assert_roundtrip")(source, **options)


def check_reversible(conversions: dict[str, list[Any]]) -> Any:
    """Renamed: ``reversibility_problems`` (the list), ``assert_reversible`` (raises)."""
    _warn("check_reversible", "reversibility_problems", " (assert_reversible raises them)")
    return __getattr__("reversibility_problems")(conversions)


@contextmanager
def without_patches() -> Iterator[None]:
    """Renamed: ``pristine``, which does all it did and also swaps the test's method patches out."""
    _warn("without_patches", "pristine", " (it yields nothing)", stacklevel=4)  # through contextlib's __enter__
    with __getattr__("pristine")():
        yield
