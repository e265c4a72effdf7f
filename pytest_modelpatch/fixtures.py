"""The plugin's fixtures (``device``, ``dtype``, ``model_builder``, ``reference_model``, ``patched_model``,
``roundtrip``, ``patch_registry``), registered by :mod:`.plugin` (its ``pytest_plugins``). What a test
item asks for (its model request, device, sweep) is read in :mod:`.item_markers`.

Nothing here imports torch or transformers at module level; each fixture imports what it needs.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import pytest

from pytest_modelpatch.errors import NotApplicableError, PatchUsageError
from pytest_modelpatch.isolation.per_test.scopes import patch_spec
from pytest_modelpatch.item_markers import (
    CHECKPOINTS_ENV,
    item_device,
    item_model_request,
    keys_that_may_match_nothing,
    load_choices,
    required_model_request,
    resolve_device,
    swept_family,
)
from pytest_modelpatch.models import devices
from pytest_modelpatch.models.memory_cache import parse_model_cache
from pytest_modelpatch.parallel.marker import MESH
from pytest_modelpatch.parallel.session import in_rank, parallel_spec
from pytest_modelpatch.reporting.session import NOT_APPLICABLE_PROPERTY, note_implementations

if TYPE_CHECKING:
    from pytest_modelpatch.isolation.registration import PatchRegistry
    from pytest_modelpatch.models.builder import LoadChoices, ModelBuilder, ModelRequest
    from pytest_modelpatch.parallel.marker import ParallelSpec


# ---------------------------------------------------------------------------
# the fixtures
# ---------------------------------------------------------------------------


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

    bound = parse_model_cache(request.config.getini("modelpatch_model_cache"))
    return ModelBuilder(checkpoint_root(tmp_path_factory), model_cache=bound)


def checkpoint_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where this session's seeded checkpoints are saved, shared by its xdist workers and parallel ranks."""
    shared = os.environ.get(CHECKPOINTS_ENV)
    if shared and in_rank():  # a rank uses the folder of the process that sent it the test
        return Path(shared)
    base = tmp_path_factory.getbasetemp()
    # under xdist every worker's basetemp sits in one run directory: share the checkpoints there
    root = base.parent if devices.xdist_worker_index() is not None else base
    return root / "modelpatch-checkpoints"


def not_applicable(item: pytest.Item, reason: str) -> NoReturn:
    """transformers refuses this family what the test asks: a skip in a sweep, an error alone (the test named it)."""
    if swept_family(item) is not None:
        item.user_properties.append((NOT_APPLICABLE_PROPERTY, reason))  # the sweep's summary counts it apart
        pytest.skip(f"not applicable: {reason}")
    raise NotApplicableError(
        f"{item.nodeid}: transformers refuses what this test asks of the model: {reason}\n"
        "This family cannot take the patch. Swept over families (@pytest.mark.model(families=...) or a list of "
        "model types) it would be skipped as not applicable; named alone it is an error. Mark the test with a family "
        "that supports it, or drop the choice from @pytest.mark.patch."
    ) from None


_REFUSAL_CHECKED = pytest.StashKey[bool]()


def refuse_early(item: pytest.Item, model_request: ModelRequest, choices: LoadChoices | None) -> None:
    """In a sweep, end the test as not applicable before any checkpoint is written when transformers refuses its implementations.

    A refused family costs milliseconds (a meta-device build) instead of a checkpoint and a reference load.
    """
    if swept_family(item) is None or item.stash.get(_REFUSAL_CHECKED, False):
        return
    item.stash[_REFUSAL_CHECKED] = True
    from pytest_modelpatch.models.applicability import load_refusal

    reason = load_refusal(
        model_request, choices.patched_kwargs(model_request) if choices else model_request.load_kwargs()
    )
    if reason is not None:
        not_applicable(item, reason)


@contextmanager
def refusals_not_applicable(item: pytest.Item) -> Iterator[None]:
    """A load or transform inside the block that transformers refuses (``X does not support ...``) ends the test as not applicable."""
    try:
        yield
    except (ValueError, NotImplementedError) as exc:
        from pytest_modelpatch.models.applicability import transformers_refusal

        reason = transformers_refusal(exc)
        if reason is None:
            raise
        not_applicable(item, reason)


def _warn_shared_implementations(model_request: ModelRequest, nodeid: str) -> None:
    """A user's implementation on the model marker runs in both models: the comparison cannot judge it."""
    from pytest_modelpatch.isolation.per_test.patch_spec import IMPLEMENTATIONS
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
def reference_model(
    model_builder: ModelBuilder, device: str, dtype: Any, request: pytest.FixtureRequest
) -> Iterator[Any]:
    """The unpatched model of ``@pytest.mark.model``, loaded with ``from_pretrained``; shared, do not modify.

    Given back after the test: anything it left changed (a hook, a weight, a mode) errors this
    test, and the next one gets a freshly built model.
    """
    model_request = required_model_request(request)
    _warn_shared_implementations(model_request, request.node.nodeid)
    choices = load_choices(request)
    refuse_early(request.node, model_request, choices)
    with refusals_not_applicable(request.node):  # the model marker's implementations load here too
        model = model_builder.reference(model_request, dtype=dtype, device=device, choices=choices)
    note_implementations(request.node, "reference", model)
    yield model
    changed = model_builder.take_back(model)
    if changed is not None:
        pytest.fail(f"{request.node.nodeid}: {changed}", pytrace=False)


@pytest.fixture
def patched_model(
    model_builder: ModelBuilder, device: str, dtype: Any, request: pytest.FixtureRequest
) -> Iterator[Any]:
    """The same weights loaded with this test's patches and conversions (``@pytest.mark.patch``).

    In a rank of a ``@pytest.mark.parallel`` test, sharded the way its kind says (the reference is not).
    """
    from pytest_modelpatch.isolation.guard import PatchStateGuard

    model_request = required_model_request(request)
    guard = PatchStateGuard()  # fusion_config registers global patches while loading
    try:
        refuse_early(request.node, model_request, load_choices(request))
        with refusals_not_applicable(request.node):
            choices, kind = sharded_choices(request, model_builder, model_request, dtype, device)
            model = _load_patched(request, model_builder, model_request, dtype, device, choices)
        note_implementations(request.node, "patched", model)
        if kind in ("tp", MESH):  # its activations and caches hold its TP rank's slice: gathered for each comparison
            from pytest_modelpatch.compare._engine.sharded import gathering_shards
            from pytest_modelpatch.parallel.sharding import tensor_parallel_group

            with gathering_shards(tensor_parallel_group(model) if kind == MESH else None):
                yield model
        else:
            yield model
    finally:
        guard.restore()


def _load_patched(
    request: pytest.FixtureRequest,
    model_builder: ModelBuilder,
    model_request: ModelRequest,
    dtype: Any,
    device: str,
    choices: LoadChoices | None,
) -> Any:
    """The builder's patched load; a usage error (nothing patched, without ``unpatched=True``) fails the test."""
    marks = patch_spec(request.node)
    try:
        return model_builder.patched(
            model_request,
            dtype=dtype,
            device=device,
            choices=choices,
            unpatched=marks is not None and marks.unpatched,
            may_match_nothing=keys_that_may_match_nothing(request.node),
        )
    except PatchUsageError as exc:  # what to fix is in the message: no traceback through the plugin
        problem = f"PatchUsageError: {request.node.nodeid}: patched_model: {exc}"
    pytest.fail(problem, pytrace=False)


def sharded_choices(
    request: pytest.FixtureRequest, model_builder: ModelBuilder, model_request: ModelRequest, dtype: Any, device: str
) -> tuple[LoadChoices | None, str | None]:
    """The patched load's choices, with the sharding of the test's ``parallel`` kind when this process is a rank."""
    choices = load_choices(request)
    spec = parallel_spec(request.node) if in_rank() else None
    if spec is None or spec.kind is None:
        return choices, None
    from pytest_modelpatch.models.builder import LoadChoices
    from pytest_modelpatch.parallel import sharding

    reference = model_builder.reference(model_request, dtype=dtype, device=device, choices=choices)
    kwargs = dict(choices.kwargs) if choices is not None else {}
    transforms = tuple(choices.transforms) if choices is not None else ()
    if spec.kind in ("tp", MESH):
        marks = patch_spec(request.node)
        structure = model_builder.patched_structure(model_request, dtype=dtype)
        plan = sharding.resolve_tp_plan(marks.tp_plan if marks is not None else {}, structure, reference)
        if plan.empty:
            sharded = "parallel('tp')" if spec.kind == "tp" else str(spec)
            pytest.skip(
                f"{type(reference).__name__} has no tensor-parallel plan (its config's base_model_tp_plan is empty): "
                f"{sharded} cannot shard it; give one with @pytest.mark.patch(tp_plan={{...}})"
            )
        load = sharding.tp_load_kwargs(plan) if spec.kind == "tp" else sharding.mesh_load_kwargs(plan, spec.mesh)
        if load is None:
            import transformers

            pytest.skip(
                f"{spec} needs DistributedConfig(fsdp_size=...), which transformers {transformers.__version__} lacks"
            )
        kwargs.update(load)
    elif spec.kind == "fsdp":
        paths = sharding.decoder_layer_paths(reference)
        transforms += (sharding.fully_shard_layers(paths, per_module=spec.layout == "per_module"),)
    else:
        transforms += (sharding.data_parallel,)
    return LoadChoices(kwargs, transforms), spec.kind


def validate_before_ranks(item: pytest.Item, spec: ParallelSpec) -> None:
    """What is wrong with how a ``parallel("tp")`` test shards, found here before any rank starts: a usage error.

    A world size that does not divide the heads; a plan entry of the patch marks that names no
    module of the patched model (built on the meta device with the marks' mapping), or one of
    transformers' that shards a module the patch replaced. The ranks check the plan again against
    the model they load.
    """
    if spec.kind not in ("tp", MESH):
        return  # nothing to resolve: the process that sends the tests imports neither torch nor transformers
    model_request = item_model_request(item)
    if model_request is None:
        return
    from pytest_modelpatch.isolation.guard import PatchStateGuard
    from pytest_modelpatch.isolation.per_test.patch_spec import collect_patch_spec
    from pytest_modelpatch.isolation.registration import register_patches
    from pytest_modelpatch.models.checkpoints import config_model_class
    from pytest_modelpatch.parallel import sharding

    config = model_request.model_spec.config
    marks = collect_patch_spec(item) if "patch" in item.keywords else None
    model_class = config_model_class(config)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if not (getattr(text, "base_model_tp_plan", None) or (marks is not None and marks.tp_plan)):
        return  # nothing to shard: the rank skips the test, saying so
    sharding.validate_tp_heads(config, spec.tp_size, model_class.__name__, str(spec) if spec.kind == MESH else "")
    if marks is None or not (marks.tp_plan or marks.mapping):
        return
    import torch

    with torch.device("meta"):
        reference = model_class._from_config(config)
        guard = PatchStateGuard()
        try:
            register_patches(marks.mapping, overwrite=True)
            patched = model_class._from_config(config)
        finally:
            guard.restore(report=False)
    sharding.resolve_tp_plan(marks.tp_plan, patched, reference)


@pytest.fixture
def roundtrip(tmp_path: Any, request: pytest.FixtureRequest) -> Any:
    """``assert_roundtrip`` bound to this test's ``tmp_path``: ``roundtrip.check(checkpoint_or_model)``.

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
    from pytest_modelpatch.lint.model_structures import meta_structures

    registry = PatchRegistry(structures=meta_structures)
    try:
        yield registry
    finally:
        registry.close()
