"""The plugin's fixtures: ``device``, ``dtype``, ``model_builder``, ``reference_model``, ``patched_model``,
``roundtrip`` and ``patch_registry``. Registered by :mod:`.plugin` (its ``pytest_plugins``).

Nothing here imports torch or transformers at module level; each fixture imports what it needs.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import pytest

from pytest_modelpatch.items import item_device, load_choices, required_model_request, resolve_device
from pytest_modelpatch.models import devices
from pytest_modelpatch.models.model_cache import parse_model_cache
from pytest_modelpatch.reporting.session import note_implementations

if TYPE_CHECKING:
    from pytest_modelpatch.isolation.registration import PatchRegistry
    from pytest_modelpatch.models.builder import ModelBuilder, ModelRequest


@pytest.fixture
def device(request: pytest.FixtureRequest) -> str:
    """The torch device this test runs on, e.g. ``"cpu"`` or ``"cuda:1"`` (one GPU per xdist worker)."""
    return resolve_device(request.node, item_device(request.node))


@pytest.fixture
def dtype(request: pytest.FixtureRequest) -> Any:
    """The ``torch.dtype`` this test runs at: from ``@pytest.mark.dtypes``, else ``torch.float32``."""
    return devices.to_torch_dtype(getattr(request, "param", "float32"))


@pytest.fixture(scope="session")
def model_builder(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> ModelBuilder:
    """Session cache of seeded checkpoints and reference models (checkpoints shared across xdist workers)."""
    from pytest_modelpatch.models.builder import ModelBuilder

    base = tmp_path_factory.getbasetemp()
    # under xdist every worker's basetemp sits in one run directory: share the checkpoints there
    root = base.parent if devices.xdist_worker_index() is not None else base
    bound = parse_model_cache(request.config.getini("modelpatch_model_cache"))
    return ModelBuilder(root / "modelpatch-checkpoints", model_cache=bound)


def _warn_shared_implementations(model_request: ModelRequest, nodeid: str) -> None:
    """A user's implementation on the model marker runs in both models: the comparison cannot judge it."""
    from pytest_modelpatch.isolation.patch_spec import IMPLEMENTATIONS
    from pytest_modelpatch.models.builder import is_transformers_own

    for axis in IMPLEMENTATIONS:
        name = getattr(model_request, axis)
        if not is_transformers_own(axis, name):
            import warnings

            from pytest_modelpatch.errors import ModelPatchWarning

            warnings.warn(
                f"{nodeid}: @pytest.mark.model({axis}={name!r}) loads both models with {name!r}, so the comparison "
                f"cannot judge it (it would pass with any bug in it). To verify it, put it on the patch marker: "
                f"@pytest.mark.patch({axis}={name!r}) loads only the patched model with it, the reference with "
                "transformers' eager one.",
                ModelPatchWarning, stacklevel=2,
            )  # fmt: skip


@pytest.fixture
def reference_model(model_builder: ModelBuilder, device: str, dtype: Any, request: pytest.FixtureRequest) -> Any:
    """The unpatched model of ``@pytest.mark.model``, loaded with ``from_pretrained``; shared, do not modify."""
    model_request = required_model_request(request)
    _warn_shared_implementations(model_request, request.node.nodeid)
    model = model_builder.reference(model_request, dtype=dtype, device=device, choices=load_choices(request))
    note_implementations(request.node, "reference", model)
    return model


@pytest.fixture
def patched_model(
    model_builder: ModelBuilder, device: str, dtype: Any, request: pytest.FixtureRequest
) -> Iterator[Any]:
    """The same weights loaded with this test's patches and conversions (``@pytest.mark.patch``)."""
    from pytest_modelpatch.isolation.guard import PatchStateGuard

    model_request = required_model_request(request)
    guard = PatchStateGuard()  # fusion_config registers global patches while loading
    try:
        model = model_builder.patched(model_request, dtype=dtype, device=device, choices=load_choices(request))
        note_implementations(request.node, "patched", model)
        yield model
    finally:
        guard.restore()


@pytest.fixture
def roundtrip(tmp_path: Any, request: pytest.FixtureRequest) -> Any:
    """``check_roundtrip`` bound to this test's ``tmp_path``: ``roundtrip.check(checkpoint_or_model)``.

    Its patched loads take the patch marks' load choices and transforms, as ``patched_model``'s do.
    """
    from pytest_modelpatch.roundtrip.check import Roundtrip

    return Roundtrip(tmp_path, load_choices(request))


@pytest.fixture
def patch_registry() -> Iterator[PatchRegistry]:
    """Register patches from the test body; all global patch state is restored afterwards.

    Example::

        def test_fused(patch_registry):
            patch_registry.register({"LlamaAttention": FusedAttention}, conversions={"llama": [...]})
    """
    from pytest_modelpatch.isolation.registration import PatchRegistry

    from pytest_modelpatch.models.structure import meta_structures

    registry = PatchRegistry(structures=meta_structures)
    try:
        yield registry
    finally:
        registry.close()
