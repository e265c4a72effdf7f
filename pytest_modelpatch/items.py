"""What a test item asks of the plugin, read from its markers, its parameters, the options and its stash.

Its model request (resolved once and stashed), the model type a sweep gave it, its device, and the
patch marks' load choices: read by the hooks in :mod:`.plugin` and the fixtures in :mod:`.fixtures`.
Nothing here imports torch or transformers at module level.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pytest

from pytest_modelpatch.errors import PatchUsageError
from pytest_modelpatch.isolation.scopes import patch_spec
from pytest_modelpatch.models import devices

if TYPE_CHECKING:
    from pytest_modelpatch.models.builder import LoadChoices, ModelRequest


GPU_SKIP = pytest.StashKey[str]()  # why a test was skipped for want of a GPU: its report points at the test
FAMILY_PARAM = "_modelpatch_family"  # the parameter a list of model types in @pytest.mark.model sweeps over


class NoCallspec:
    """The ``callspec`` of an item that was not parametrized: no parameters."""

    params: dict[str, Any] = {}


def _swept_marker_args(item: pytest.Item, mark: pytest.Mark) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """A sweep's marker as this item's one-family marker: its model type in place of the list or ``families=``."""
    family = getattr(item, "callspec", NoCallspec).params.get(FAMILY_PARAM)
    if family is None:
        return mark.args, mark.kwargs
    if "families" in mark.kwargs:
        return (family,), {k: v for k, v in mark.kwargs.items() if k != "families"}
    return (family, *mark.args[1:]), mark.kwargs


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
        return ModelRequest.from_marker(args, kwargs, item.nodeid if args is not mark.args else node.nodeid or node.name)
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
