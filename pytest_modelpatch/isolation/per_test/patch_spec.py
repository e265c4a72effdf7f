"""Parse and merge ``@pytest.mark.patch(...)`` marks into one ``PatchSpec``.

Marks at function, class and module level (``pytestmark``) all apply; they merge,
and two marks giving one key different values is a usage error naming both.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import pytest

from pytest_modelpatch.errors import PatchUsageError
from pytest_modelpatch.settings import IMPLEMENTATION_KEYWORDS

if TYPE_CHECKING:
    from _pytest.nodes import Node  # what iter_markers_with_node yields; pytest exports no name for it

# the from_pretrained choices of both markers that select an implementation; the builder loads the
# reference with transformers' eager one on each axis only the patch marker sets
IMPLEMENTATIONS = IMPLEMENTATION_KEYWORDS
_IMPLEMENTATION_ARGS = "".join(f"{axis}=None, " for axis in IMPLEMENTATIONS)
PATCH_MARKER_HELP = (
    "patch(mapping=None, *, conversions=None, overwrite=False, methods=None, allow=None, context=None, "
    f"{_IMPLEMENTATION_ARGS}load_kwargs=None, transform=None, tp_plan=None, unpatched=False, "
    "**context_kwargs): register transformers patches for this test and restore all global patch state afterwards; "
    "the load choices, transforms and tensor-parallel plan entries reach the patched model only; a patched model "
    "with nothing patched is a usage error unless unpatched=True says it is the stock model on purpose (a baseline)"
)
_KEYWORDS = (
    "mapping", "conversions", "overwrite", "methods", "allow", "context",
    *IMPLEMENTATIONS, "load_kwargs", "transform", "tp_plan", "unpatched",
)  # fmt: skip


def _where(node: Node) -> str:
    return node.nodeid or node.name


@dataclass
class PatchSpec:
    """Everything the ``patch`` marks of one test ask for, merged."""

    mapping: dict[str, type] = field(default_factory=dict)
    conversions: dict[str, list[Any]] = field(default_factory=dict)
    overwrite: bool = False
    methods: list[Any] = field(default_factory=list)
    allow: dict[str, list[str]] = field(default_factory=dict)
    contexts: list[tuple[Callable[..., Any], dict[str, Any]]] = field(default_factory=list)
    # from_pretrained choices for the patched load only: implementations, then any other keyword
    load_kwargs: dict[str, Any] = field(default_factory=dict)
    transforms: list[Callable[[Any], Any]] = field(default_factory=list)  # fn(model) -> model or None, in order
    # entries merged into the patched model's tensor-parallel plan under @pytest.mark.parallel("tp"); None removes one
    tp_plan: dict[str, str | None] = field(default_factory=dict)
    # the patched model may be the stock one: a deliberate baseline, not a patch that was forgotten
    unpatched: bool = False
    _origin: dict[tuple[str, str], str] = field(default_factory=dict)

    @property
    def load_choices(self) -> bool:
        """The marks change how the patched model is loaded or transformed, not only what is registered."""
        return bool(self.load_kwargs or self.transforms)

    def _merge_key(self, kind: str, target: dict[str, Any], key: str, value: Any, where: str) -> None:
        if key in target and target[key] is not value and target[key] != value:
            raise PatchUsageError(
                f"@pytest.mark.patch: {kind} key {key!r} is given two different values: "
                f"{_name(target[key])} (mark on {self._origin[(kind, key)]}) and {_name(value)} (mark on {where}). "
                "Keep one of the marks, or use different keys."
            )
        target[key] = value
        self._origin.setdefault((kind, key), where)


def _name(value: Any) -> str:
    if isinstance(value, type):
        return f"{value.__module__}.{value.__qualname__}"
    return repr(value)


def collect_patch_spec(item: pytest.Item) -> PatchSpec | None:
    """Merge every ``patch`` mark on ``item`` (closest first); ``None`` when there are none."""
    found = list(item.iter_markers_with_node("patch"))
    if not found:
        return None
    spec = PatchSpec()
    for node, mark in found:
        _merge_mark(spec, mark, _where(node))
    return spec


def _merge_mark(spec: PatchSpec, mark: pytest.Mark, where: str) -> None:
    kwargs = dict(mark.kwargs)
    if len(mark.args) > 1:
        raise PatchUsageError(
            f"@pytest.mark.patch on {where} takes one positional argument, the mapping; got {len(mark.args)}. "
            "Merge the dicts, or pass conversions=/methods=/context= by keyword."
        )
    if mark.args:
        if "mapping" in kwargs:
            raise PatchUsageError(f"@pytest.mark.patch on {where} got the mapping both positionally and as mapping=.")
        kwargs["mapping"] = mark.args[0]
    context = kwargs.pop("context", None)
    extra = {k: v for k, v in kwargs.items() if k not in _KEYWORDS}
    if extra and context is None:
        raise PatchUsageError(
            f"@pytest.mark.patch on {where} got unknown keyword(s) {sorted(extra)}. It takes "
            f"{', '.join(_KEYWORDS)}; extra keywords are only allowed with context=factory, which receives them."
        )
    for keyword, kind, target, shape in (
        (
            "mapping",
            "patch",
            spec.mapping,
            "{class name or regex: replacement class}, e.g. {'LlamaAttention': MyAttention}",
        ),
        ("conversions", "conversions", spec.conversions, "{model_type: [WeightConverter, ...]}"),
    ):
        given = kwargs.get(keyword) or {}
        if not isinstance(given, Mapping):
            raise PatchUsageError(
                f"@pytest.mark.patch on {where}: {keyword} must be a dict {shape}, got {type(given).__name__}."
            )
        for key, value in given.items():
            spec._merge_key(kind, target, key, value, where)
    overwrite = kwargs.get("overwrite", False)
    if not isinstance(overwrite, bool):
        raise PatchUsageError(f"@pytest.mark.patch on {where}: overwrite must be True or False, got {overwrite!r}.")
    spec.overwrite = spec.overwrite or overwrite
    unpatched = kwargs.get("unpatched", False)
    if not isinstance(unpatched, bool):
        raise PatchUsageError(
            f"@pytest.mark.patch on {where}: unpatched must be True (the patched model is the stock one on purpose) "
            f"or False, got {unpatched!r}."
        )
    spec.unpatched = spec.unpatched or unpatched
    methods = kwargs.get("methods") or []
    if not isinstance(methods, (list, tuple)):
        methods = [methods]
    spec.methods.extend(m for m in methods if m not in spec.methods)
    allow = kwargs.get("allow") or {}
    if not isinstance(allow, Mapping):
        raise PatchUsageError(
            f"@pytest.mark.patch on {where}: allow must be a dict {{key: ['CONTAINER', ...]}}, got {allow!r}."
        )
    for key, kinds in allow.items():
        kinds_list = [kinds] if isinstance(kinds, str) else list(kinds)
        spec.allow.setdefault(key, [])
        spec.allow[key].extend(k for k in kinds_list if k not in spec.allow[key])
    _merge_load_choices(spec, kwargs, where)
    _merge_tp_plan(spec, kwargs.get("tp_plan"), where)
    if context is not None:
        if not callable(context):
            raise PatchUsageError(
                f"@pytest.mark.patch on {where}: context must be a callable returning a context manager "
                f"(e.g. a @contextmanager function), got {context!r}."
            )
        spec.contexts.append((context, extra))


def _merge_load_choices(spec: PatchSpec, kwargs: dict[str, Any], where: str) -> None:
    given = kwargs.get("load_kwargs") or {}
    if not isinstance(given, Mapping):
        raise PatchUsageError(
            f"@pytest.mark.patch on {where}: load_kwargs must be a dict of from_pretrained keywords, e.g. "
            f"{{'use_kernels': True}}, got {type(given).__name__}."
        )
    given = dict(given)
    for axis in IMPLEMENTATIONS:
        value = kwargs.get(axis)
        if value is None:
            continue
        if not isinstance(value, str):
            raise PatchUsageError(
                f"@pytest.mark.patch on {where}: {axis} must be a name (register a function first, e.g. "
                f"AttentionInterface.register('my_attn', fn), then pass 'my_attn'), got {value!r}."
            )
        if axis in given and given[axis] != value:
            raise PatchUsageError(f"@pytest.mark.patch on {where}: {axis} is given both directly and in load_kwargs.")
        given[axis] = value
    for key, value in given.items():
        spec._merge_key("load_kwargs", spec.load_kwargs, key, value, where)
    transforms = kwargs.get("transform") or []
    for transform in transforms if isinstance(transforms, (list, tuple)) else [transforms]:
        if not callable(transform):
            raise PatchUsageError(
                f"@pytest.mark.patch on {where}: transform must be a callable fn(model) returning a model or None "
                f"(applied to the patched model after it loads), got {transform!r}."
            )
        if transform not in spec.transforms:
            spec.transforms.append(transform)


def _merge_tp_plan(spec: PatchSpec, given: Any, where: str) -> None:
    if given is None:
        return
    if not isinstance(given, Mapping) or not all(
        isinstance(k, str) and (v is None or isinstance(v, str)) for k, v in given.items()
    ):
        raise PatchUsageError(
            f"@pytest.mark.patch on {where}: tp_plan must be a dict {{module pattern: style or None}}, written as "
            "config.base_model_tp_plan is, e.g. {'layers.*.self_attn.qkv_proj': 'colwise', "
            f"'layers.*.self_attn.q_proj': None}}; got {given!r}."
        )
    for key, value in given.items():
        spec._merge_key("tp_plan", spec.tp_plan, key, value, where)
