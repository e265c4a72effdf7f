"""What a test item asks of the plugin, read from its marks: its model request (resolved once and
stashed), the model type a sweep gave it, its device, the patch marks' load choices, and the marker
usage errors that belong to one test (found at collection, raised at its setup).

The fixtures in :mod:`.fixtures` and the hooks in :mod:`.plugin` read it. Nothing here imports torch
or transformers at module level.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import pytest

from pytest_modelpatch.errors import PatchUsageError
from pytest_modelpatch.isolation.per_test.scopes import patch_spec
from pytest_modelpatch.models import devices

if TYPE_CHECKING:
    from pytest_modelpatch.models.builder import LoadChoices, ModelRequest


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


def _swept_marker_args(item: pytest.Item, mark: pytest.Mark) -> tuple[tuple[Any, ...], Mapping[str, Any]]:
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
