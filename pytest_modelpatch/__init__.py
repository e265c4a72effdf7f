"""pytest-modelpatch: prove that a patched transformers model is still the model.

The face: the checks (``assert_*`` one comparison, ``check_*`` over drawn inputs), their reports,
tolerances and the base errors. The rest is in documented submodules, each with its own
``__all__``: :mod:`.strategies`, :mod:`.models`, :mod:`.isolation`, :mod:`.lint`, :mod:`.report`,
:mod:`.roundtrip` and :mod:`.errors` (docs/reference.md). Importing this package imports neither
torch nor transformers; each public name is loaded from its module on first access.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

__version__ = "0.1.0"


def lazy_exports(package: str, exports: dict[str, str]) -> Callable[[str], Any]:
    """The loader behind a face module's ``__getattr__``: each of ``exports`` (name -> module under
    ``pytest_modelpatch``) is imported on first access and kept, so a face imports nothing heavy."""

    def load(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
        setattr(importlib.import_module(package), name, value)
        return value

    return load


# public name -> module that defines it. The naming rule (docs/reference.md): assert_* runs one
# comparison and raises; check_* runs it over drawn inputs.
_EXPORTS: dict[str, str] = {
    # errors.py: the base of every error, and the one a wrong use raises (the rest: pytest_modelpatch.errors)
    "ModelPatchError": "errors",
    "PatchUsageError": "errors",
    # compare/: the checks, their reports, tolerances
    "assert_equivalent": "compare.equivalence",
    "EquivalenceReport": "compare.equivalence",
    "check_equivalent": "compare.property_checks",
    "check_backward_equivalent": "compare.property_checks",
    "PropertyReport": "compare.property_checks",
    "assert_backward_equivalent": "compare.backward",
    "BackwardReport": "compare.backward",
    "assert_decodes_equivalent": "compare.decoding",
    "DecodingReport": "compare.decoding",
    "check_decodes_equivalent": "compare.decoding_properties",
    "DecodingPropertyReport": "compare.decoding_properties",
    "assert_trains_equivalent": "compare.training_steps",
    "TrainingReport": "compare.training_steps",
    "assert_module_equivalent": "compare.divergence",
    "ModuleEquivalenceReport": "compare.divergence",
    "assert_exports_equivalent": "compare.graph.export",
    "ExportReport": "compare.graph.export",
    "assert_compiles_equivalent": "compare.graph.compile",
    "CompileReport": "compare.graph.compile",
    "ParityReport": "compare.graph.parity",
    "TolerancePolicy": "compare.tolerance",
    "DtypeTolerance": "compare.tolerance",
    "ToleranceSpec": "compare.tolerance",
    "resolve_tolerance": "compare.tolerance",
    "sqnr_policy": "compare.tolerance",
    "oracle_policy": "compare.tolerance",
    "DEFAULT_POLICY": "compare.tolerance",
    "LOOSE_POLICY": "compare.tolerance",
    "STRICT_POLICY": "compare.tolerance",
    # roundtrip/ and isolation/: the checks of lossless save and load and of reversible conversions
    "assert_roundtrip": "roundtrip.check",
    "RoundtripReport": "roundtrip.check",
    "assert_reversible": "isolation.reversibility",
}

__all__ = sorted(_EXPORTS) + ["__version__"]

_load = lazy_exports(__name__, _EXPORTS)


def __getattr__(name: str) -> Any:
    return _load(name)


def __dir__() -> list[str]:
    return __all__
