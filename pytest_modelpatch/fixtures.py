"""The plugin's fixtures (``device``, ``dtype``, ``model_builder``, ``reference_model``, ``patched_model``,
``roundtrip``, ``patch_registry``) and what a test item asks of the plugin, which they and the hooks
in :mod:`.plugin` read: its model request (resolved once and stashed), the model type a sweep gave
it, its device, and the patch marks' load choices. Registered by :mod:`.plugin` (its ``pytest_plugins``).

Nothing here imports torch or transformers at module level; each fixture imports what it needs.
"""

from __future__ import annotations

import difflib
import os
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import pytest

from pytest_modelpatch.errors import NotApplicableError, PatchUsageError
from pytest_modelpatch.isolation.per_test.scopes import patch_spec
from pytest_modelpatch.models import devices
from pytest_modelpatch.models.memory_cache import parse_model_cache
from pytest_modelpatch.parallel.session import in_rank, parallel_spec
from pytest_modelpatch.reporting.session import NOT_APPLICABLE_PROPERTY, note_implementations

if TYPE_CHECKING:
    from pytest_modelpatch.isolation.registration import PatchRegistry
    from pytest_modelpatch.models.builder import LoadChoices, ModelBuilder, ModelRequest
    from pytest_modelpatch.parallel.marker import ParallelSpec


# ---------------------------------------------------------------------------
# what a test item asks for
# ---------------------------------------------------------------------------


CHECKPOINTS_ENV = "MODELPATCH_CHECKPOINTS"  # a rank's checkpoint folder: the one of the session that started it
GPU_SKIP = pytest.StashKey[str]()  # why a test was skipped for want of a GPU: its report points at the test
FAMILY_PARAM = "_modelpatch_family"  # the parameter a list of model types in @pytest.mark.model sweeps over


class NoCallspec:
    """The ``callspec`` of an item that was not parametrized: no parameters."""

    params: dict[str, Any] = {}


def swept_family(item: pytest.Item) -> str | None:
    """The model type a sweep (``families=`` or a list in ``@pytest.mark.model``) gave this test, else ``None``."""
    return getattr(item, "callspec", NoCallspec).params.get(FAMILY_PARAM)


def _swept_marker_args(item: pytest.Item, mark: pytest.Mark) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """A sweep's marker as this item's one-family marker: its model type in place of the list or ``families=``."""
    family = swept_family(item)
    if family is None:
        return mark.args, mark.kwargs
    if "families" in mark.kwargs:
        return (family,), {k: v for k, v in mark.kwargs.items() if k != "families"}
    return (family, *mark.args[1:]), mark.kwargs


def patched_sweep_family(item: pytest.Item) -> str | None:
    """The model type a ``families="patched"`` sweep gave this test, else ``None`` (a named family is held strictly)."""
    family = swept_family(item)
    mark = item.get_closest_marker("model") if family is not None else None
    return family if mark is not None and mark.kwargs.get("families") == "patched" else None


def no_match_allowed(allow: Mapping[str, Iterable[str]]) -> set[str]:
    """The keys whose ``allow=`` accepts ``NO_MATCH``: the test says they may replace nothing."""
    return {key for key, kinds in allow.items() if "NO_MATCH" in {str(kind).upper() for kind in kinds}}


def keys_that_may_match_nothing(item: pytest.Item) -> set[str]:
    """The test's mapping keys its load may find replacing nothing: those whose ``NO_MATCH`` it allows, and in a
    ``families="patched"`` sweep those that replace no class of this family (they are there for the others)."""
    spec = patch_spec(item)
    if spec is None:
        return set()
    optional = no_match_allowed(spec.allow)
    family = patched_sweep_family(item)
    if family is not None:
        from pytest_modelpatch.models.sweeps import keys_in_family

        optional |= set(spec.mapping) - keys_in_family(spec.mapping, family)
    return optional


_MODEL_REQUEST = pytest.StashKey["ModelRequest | None"]()
_UNRESOLVED: Any = object()  # not None: no model asked for is an answer too


def item_model_request(item: pytest.Item) -> ModelRequest | None:
    """The test's model request, resolved on first need and kept on the item for the rest of it.

    The patch marks' lint, both model fixtures and the builder's loads all read this one (a tiny
    config is built anew on each resolution); a test that uses no model never resolves one. A
    wrong marker is not kept: each reader raises its usage error again.
    """
    request = item.stash.get(_MODEL_REQUEST, _UNRESOLVED)
    if request is _UNRESOLVED:
        request = item.stash[_MODEL_REQUEST] = _marked_model_request(item)
    return request


def _marked_model_request(item: pytest.Item) -> ModelRequest | None:
    """The test's ``@pytest.mark.model``, else ``--modelpatch-checkpoint``, else ``None``."""
    from pytest_modelpatch.models.builder import ModelRequest

    found = next(iter(item.iter_markers_with_node("model")), None)
    if found is not None:
        node, mark = found
        args, kwargs = _swept_marker_args(item, mark)  # a sweep: this item's model type
        return ModelRequest.from_marker(
            args, kwargs, item.nodeid if args is not mark.args else node.nodeid or node.name
        )
    default = item.config.getoption("modelpatch_checkpoint")
    return ModelRequest(default) if default else None


def required_model_request(request: pytest.FixtureRequest) -> ModelRequest:
    """The test's model request, for a fixture that cannot do without one (a usage error when there is none)."""
    model_request = item_model_request(request.node)
    if model_request is None:
        raise PatchUsageError(
            f"{request.fixturename} needs a model: mark the test with @pytest.mark.model('llama') (a model type, "
            "a PretrainedConfig or a checkpoint directory), or pass --modelpatch-checkpoint PATH."
        )
    return model_request


def load_choices(request: pytest.FixtureRequest) -> LoadChoices | None:
    """The patch marks' load choices and transforms (for the patched load; the reference's follow from them)."""
    spec = patch_spec(request.node)
    if spec is None or not spec.load_choices:
        return None
    from pytest_modelpatch.models.builder import LoadChoices

    return LoadChoices(dict(spec.load_kwargs), tuple(spec.transforms))


def item_device(item: pytest.Item) -> str:
    """What the test asks for: its devices() param, a cpu/gpu mark, or the session default."""
    callspec = getattr(item, "callspec", None)
    if callspec is not None and "device" in callspec.params:
        return str(callspec.params["device"])
    if item.get_closest_marker("cpu") is not None:
        return "cpu"
    requested = devices.requested_device(item.config.getoption("modelpatch_device"))
    if item.get_closest_marker("gpu") is not None and not devices.needs_gpu(requested):
        return "cuda"
    return requested


def resolve_device(item: pytest.Item, requested: str) -> str:
    """Pick the concrete device; skip (or fail under --modelpatch-require-gpu) when a GPU is missing."""
    if requested == "cpu":
        return requested
    status = devices.cuda_status()
    device = devices.select_device(requested, status, devices.xdist_worker_index())
    reason = devices.gpu_missing_reason(device, status) if devices.needs_gpu(device) else None
    if reason is not None:
        if item.config.getoption("modelpatch_require_gpu"):
            pytest.fail(f"{reason}; --modelpatch-require-gpu forbids skipping it", pytrace=False)
        item.stash[GPU_SKIP] = reason
        pytest.skip(reason)
    return device


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
def reference_model(model_builder: ModelBuilder, device: str, dtype: Any, request: pytest.FixtureRequest) -> Any:
    """The unpatched model of ``@pytest.mark.model``, loaded with ``from_pretrained``; shared, do not modify."""
    model_request = required_model_request(request)
    _warn_shared_implementations(model_request, request.node.nodeid)
    choices = load_choices(request)
    refuse_early(request.node, model_request, choices)
    with refusals_not_applicable(request.node):  # the model marker's implementations load here too
        model = model_builder.reference(model_request, dtype=dtype, device=device, choices=choices)
    note_implementations(request.node, "reference", model)
    return model


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
        if kind == "tp":  # its activations and caches hold this rank's slice: gathered for each comparison
            from pytest_modelpatch.compare._engine.sharded import gathering_shards

            with gathering_shards():
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
    if spec.kind == "tp":
        marks = patch_spec(request.node)
        structure = model_builder.patched_structure(model_request, dtype=dtype)
        plan = sharding.resolve_tp_plan(marks.tp_plan if marks is not None else {}, structure, reference)
        if plan.empty:
            pytest.skip(
                f"{type(reference).__name__} has no tensor-parallel plan (its config's base_model_tp_plan is empty): "
                "parallel('tp') cannot shard it; give one with @pytest.mark.patch(tp_plan={...})"
            )
        kwargs.update(sharding.tp_load_kwargs(plan))
    elif spec.kind == "fsdp":
        transforms += (sharding.fully_shard_layers(sharding.decoder_layer_paths(reference)),)
    else:
        transforms += (sharding.data_parallel,)
    return LoadChoices(kwargs, transforms), spec.kind


def check_before_ranks(item: pytest.Item, spec: ParallelSpec) -> None:
    """What is wrong with how a ``parallel("tp")`` test shards, found here before any rank starts: a usage error.

    A world size that does not divide the heads; a plan entry of the patch marks that names no
    module of the patched model (built on the meta device with the marks' mapping), or one of
    transformers' that shards a module the patch replaced. The ranks check the plan again against
    the model they load.
    """
    if spec.kind != "tp":
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
    sharding.check_tp_heads(config, spec.world_size, model_class.__name__)
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
    from pytest_modelpatch.models.structure import meta_structures

    registry = PatchRegistry(structures=meta_structures)
    try:
        yield registry
    finally:
        registry.close()


# ---------------------------------------------------------------------------
# usage errors that belong to one test: found at collection, raised at its setup
# ---------------------------------------------------------------------------


_DEFERRED = pytest.StashKey[dict[str, str]]()  # a test function's node id (no parameters) -> its marker's error
_REGISTERED_MARKS = pytest.StashKey[frozenset[str]]()


def defer_usage_error(metafunc: pytest.Metafunc, error: PatchUsageError) -> None:
    """Keep a marker error found while parametrizing, to fail this test's items at setup.

    Raised from ``pytest_generate_tests`` it would be a collection error, which stops the whole
    session before any test runs: one test's wrong marker must cost that test only.
    """
    metafunc.config.stash.setdefault(_DEFERRED, {})[metafunc.definition.nodeid] = f"PatchUsageError: {error}"


def _deferred_error(item: pytest.Item) -> str | None:
    deferred = item.config.stash.get(_DEFERRED, None)
    if not deferred or not isinstance(item, pytest.Function):
        return None
    return deferred.get(f"{item.parent.nodeid}::{item.originalname}" if item.parent else item.originalname)


def _registered_marks(config: pytest.Config) -> frozenset[str]:
    """Every marker name the session registered (pytest's, plugins', the ini's), as pytest reads them."""
    names = config.stash.get(_REGISTERED_MARKS, None)
    if names is None:
        lines = config.getini("markers")
        names = config.stash[_REGISTERED_MARKS] = frozenset(line.split(":")[0].split("(")[0].strip() for line in lines)
    return names


def misspelled_marker(item: pytest.Item, ours: Sequence[str]) -> str | None:
    """A mark on ``item`` that is registered nowhere and close to one of ``ours``: the error naming the fix.

    pytest only warns of an unknown mark (``PytestUnknownMarkWarning``), so ``@pytest.mark.patches({...})``
    would run the test unpatched and pass.
    """
    registered = _registered_marks(item.config)
    for mark in item.iter_markers():
        if mark.name in registered:
            continue
        close = difflib.get_close_matches(mark.name, ours, n=1, cutoff=0.75)
        if close:
            return (
                f"PatchUsageError: {item.nodeid}: @pytest.mark.{mark.name} is not a marker pytest-modelpatch knows, "
                f"so it would do nothing. Did you mean @pytest.mark.{close[0]}? (If {mark.name!r} is a marker of "
                "your own, register it under markers in your ini file.)"
            )
    return None


_STRICT_UNKNOWN = re.compile(r"'(\w+)' not found in `markers` configuration option")


def name_misspelled_marker(report: pytest.CollectReport, ours: Sequence[str]) -> None:
    """Under ``--strict-markers`` pytest refuses a file with an unknown mark: add the did-you-mean to its error."""
    found = _STRICT_UNKNOWN.search(report.longreprtext)
    if found is None:
        return
    close = difflib.get_close_matches(found.group(1), ours, n=1, cutoff=0.75)
    if close:
        report.longrepr = (
            f"{report.longreprtext.rstrip()}\nPatchUsageError: @pytest.mark.{found.group(1)} is not a marker "
            f"pytest-modelpatch knows. Did you mean @pytest.mark.{close[0]}?"
        )


def raise_usage_error(item: pytest.Item, ours: Sequence[str]) -> None:
    """Fail the test, at setup and without a traceback, on a marker error kept from collection or a misspelled mark."""
    problem = _deferred_error(item) or misspelled_marker(item, ours)
    if problem is not None:
        pytest.fail(problem, pytrace=False)
