"""Keep a shared reference model pristine: built, called and verified outside the test's patches.

A reference model is built once per session and handed to many tests, each with other
patches. :func:`prepare_reference` makes it safe to share:

- its output-capture hooks (``hidden_states``, ``attentions``) are installed at build time,
  in the pristine world. transformers installs them lazily, on the first call, from the
  class-level ``_can_record_outputs`` table, which a patched model built earlier in the same
  test has re-pointed at the replacement classes: a reference first called then would never
  capture again, in any later test (transformers 5.x ``utils/output_capturing.py``);
- every call enters the current test's pristine scope (:func:`~pytest_modelpatch.isolation.pristine.running_pristine`),
  so method and context patches are swapped out while it runs (the patch and conversion
  registries act only while a model is built, and it was built in ``pristine()``);
- what it was built with (its module classes' attributes, its capture hooks) is recorded, and
  :func:`reference_problems` says what differs now. Every call checks it, and fails with
  :class:`~pytest_modelpatch.errors.ReferenceNotPristineError` rather than compare a patched
  reference with a patched model;
- what it holds (hooks of every kind, modules, parameters, buffers, modes) is recorded too
  (:class:`~pytest_modelpatch.models.reference_state.ReferenceState`), and
  :func:`reference_changes` says what a test changed in it since.
"""

from __future__ import annotations

import functools
import operator
import types
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch

from pytest_modelpatch.errors import ReferenceNotPristineError
from pytest_modelpatch.isolation.pristine import pristine, running_pristine
from pytest_modelpatch.models.reference_state import ReferenceChanges, ReferenceState, defined_in

_RECORD = "_modelpatch_reference_record"
_STATE = "_modelpatch_reference_state"


@dataclass
class ReferenceRecord:
    """What a reference model was built with, to check it is still that model."""

    classes: dict[type, dict[str, Any]]
    hooks: dict[str, int]  # module name -> forward hooks installed at build time
    # model -> what full_problems read when it last found nothing (weak: a released model takes its entry along)
    _clean: weakref.WeakKeyDictionary[torch.nn.Module, _Fingerprint] = field(
        default_factory=weakref.WeakKeyDictionary, repr=False, compare=False
    )

    def __deepcopy__(self, memo: dict[int, Any]) -> ReferenceRecord:
        # a copy of the reference (a float64 oracle, say) was built with the same classes: share the record
        return self

    def problems(self, model: torch.nn.Module) -> list[str]:
        """:meth:`full_problems`, skipped when nothing it reads changed since it last found none.

        The fingerprint holds every object ``full_problems`` reads (each ``_modules`` entry and
        module type, each class ``__dict__`` entry, each hooked module's hook count), compared by
        identity: when all are the same objects, its answer is the same ``[]``.
        """
        last = self._clean.get(model)
        if last is not None and last.holds(model):
            return []
        found = self.full_problems(model)
        if found and self._adopt_own_rewiring(model):
            found = self.full_problems(model)
        if not found:
            self._clean[model] = _Fingerprint(model, self)
        return found

    def _adopt_own_rewiring(self, model: torch.nn.Module) -> bool:
        """Take the model's own structural changes into the record; ``False`` when something else changed.

        BigBird swaps its block-sparse attention modules for full-attention ones when an input is
        short (``set_attention_type`` in its forward): new modules of another class of its own
        modeling file, without the capture hooks the old ones had (transformers hooks a model once).
        Adopted only when every stranger is such a class, as its module defines it, and no class
        of the build was altered; a replacement from anywhere else is still a problem.
        """
        modules = dict(model.named_modules())
        files = {cls.__module__ for cls in self.classes if cls.__module__.startswith("transformers.")}
        strangers = {type(m) for m in modules.values() if type(m) not in self.classes}
        if not strangers or not all(defined_in(cls, files) for cls in strangers) or self._altered_classes():
            return False
        lost = [name for name in self.hooks if _lost_hooks(modules.get(name), self.hooks[name])]
        # only hooks of modules that are themselves new may go; lost hooks elsewhere stay a problem
        if any(modules.get(name) is not None and type(modules[name]) not in strangers for name in lost):
            return False
        for cls in strangers:
            self.classes[cls] = _code(cls)
        for name in lost:
            del self.hooks[name]
        return True

    def full_problems(self, model: torch.nn.Module) -> list[str]:
        """What differs from the build: replaced module classes, rebound methods, lost capture hooks."""
        found = []
        modules = dict(model.named_modules())
        for name, module in modules.items():
            if type(module) not in self.classes:
                found.append(
                    f"module {name or '<root>'} is a {type(module).__qualname__}, not one of the family's classes"
                )
        found += self._altered_classes()
        for name, count in self.hooks.items():
            if _lost_hooks(modules.get(name), count):
                found.append(f"the output-capture hooks of {name or '<root>'} are gone")
        return found

    def _altered_classes(self) -> list[str]:
        """Methods of the build's classes rebound or deleted since."""
        found = []
        for cls, attributes in self.classes.items():
            now = _code(cls)
            for attr in attributes.keys() | now.keys():
                if now.get(attr) is not attributes.get(attr):
                    change = f"replaced (by {_describe(now[attr])})" if attr in now else "deleted"
                    found.append(f"{cls.__qualname__}.{attr} was {change}")
        return found


class _Fingerprint:
    """The objects :meth:`ReferenceRecord.full_problems` reads, as they were when it last found nothing.

    Holds no reference to the model itself (its submodules, yes), so it can be a weak dictionary's value.
    """

    def __init__(self, model: torch.nn.Module, record: ReferenceRecord) -> None:
        modules = dict(model.named_modules())
        self.root_type = type(model)
        self.others = [m for m in modules.values() if m is not model]
        self.types = list(map(type, self.others))
        # copies of every _modules table: equal again means the same submodule objects, in the same places
        self.tables = [dict(table) for table in self._tables(model)]
        self.namespaces = [vars(c) for c in record.classes]
        self.sizes = [len(namespace) for namespace in self.namespaces]
        self.getters = [operator.itemgetter(*namespace) for namespace in self.namespaces]
        self.values = [get(namespace) for get, namespace in zip(self.getters, self.namespaces)]
        self.root_hooks = record.hooks.get("", 0)
        hooked = [(modules[name], count) for name, count in record.hooks.items() if name and name in modules]
        self.hooked, self.hook_counts = [m for m, _ in hooked], [count for _, count in hooked]

    def _tables(self, model: torch.nn.Module) -> list[dict[str, Any]]:
        return [model._modules, *map(_MODULES, self.others)]

    def holds(self, model: torch.nn.Module) -> bool:
        """Every object is the one seen then (modules, types and class entries by identity; hook counts at least).

        Compared as lists and dicts, in C, identity first: a Python loop over every module and
        class entry, or a list of each table's items, costs each call of a reference more.
        Equal tables hold the same submodules, so ``others`` is the whole tree again and its
        types are the ones to check (a class swapped in place through ``__class__``).
        """
        if type(model) is not self.root_type or len(model._forward_hooks) < self.root_hooks:
            return False
        try:
            values = [get(namespace) for get, namespace in zip(self.getters, self.namespaces)]
            return (
                self._tables(model) == self.tables
                and list(map(type, self.others)) == self.types
                and list(map(len, self.namespaces)) == self.sizes
                and values == self.values
                and all(map(operator.ge, [len(m._forward_hooks) for m in self.hooked], self.hook_counts))
            )
        except Exception:  # noqa: BLE001 - an entry deleted (KeyError), or a replaced one whose == raises
            return False  # full_problems() looks closer


_MODULES = operator.attrgetter("_modules")


def _code(cls: type) -> dict[str, Any]:
    """The methods, properties and nested classes a class defines itself (not lazily cached values)."""
    return {
        name: value for name, value in vars(cls).items()
        if not name.startswith("__") and (callable(value) or isinstance(value, (staticmethod, classmethod, property)))
    }  # fmt: skip


def _lost_hooks(module: torch.nn.Module | None, count: int) -> bool:
    return module is None or len(module._forward_hooks) < count


def _describe(value: Any) -> str:
    inner = getattr(value, "__func__", value)
    return f"{getattr(inner, '__module__', '?')}.{getattr(inner, '__qualname__', type(value).__name__)}"


def install_capture_hooks(model: torch.nn.Module) -> None:
    """Install transformers' output-capture hooks now, from the class tables as they are now."""
    try:
        from transformers.utils.output_capturing import maybe_install_capturing_hooks
    except ImportError:  # transformers without lazily installed capture hooks: nothing to pin
        return
    from transformers import PreTrainedModel

    for module in model.modules():
        # only where transformers would install them itself (on the first call of a
        # capture_outputs forward; backbones at build): installing from a model whose forward
        # never captures re-installs them on its sub-models, already hooked at build time
        # (LW-DETR's ViT, PP-LCNet backbones), and every hidden state is then recorded twice
        if isinstance(module, PreTrainedModel) and _captures_on_call(type(module).forward):
            maybe_install_capturing_hooks(module)


def _captures_on_call(forward: Any) -> bool:
    """Whether ``forward`` is wrapped by transformers' ``capture_outputs`` (under any other decorators)."""
    from transformers.utils import output_capturing

    seen = 0
    while forward is not None and seen < 16:  # the decorators chain through functools.wraps
        code = getattr(forward, "__code__", None)
        if code is not None and code.co_filename == output_capturing.__file__:
            return True
        forward, seen = getattr(forward, "__wrapped__", None), seen + 1
    return False


def record_reference(model: torch.nn.Module) -> ReferenceRecord:
    classes = {cls: _code(cls) for cls in {type(m) for m in model.modules()}}
    hooks = {name: len(m._forward_hooks) for name, m in model.named_modules() if m._forward_hooks}
    return ReferenceRecord(classes, hooks)


def prepare_reference(model: torch.nn.Module) -> torch.nn.Module:
    """Pin capture hooks, record the build, and make every call run pristine and verified. Call in ``pristine()``."""
    install_capture_hooks(model)
    record = record_reference(model)
    setattr(model, _RECORD, record)
    scopes: list[Any] = []

    def enter(module: torch.nn.Module, args: Any, kwargs: Any) -> None:
        scope = running_pristine()
        scope.__enter__()
        problems = record.problems(module)
        if problems:
            scope.__exit__(None, None, None)
            scopes.append(None)
            raise ReferenceNotPristineError(_message(module, problems))
        scopes.append(scope)

    def leave(module: torch.nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        scope = scopes.pop() if scopes else None
        if scope is not None:
            scope.__exit__(None, None, None)

    model.register_forward_pre_hook(enter, with_kwargs=True)
    model.register_forward_hook(leave, with_kwargs=True, always_call=True)
    _resolve_forward_when_called(model)
    setattr(model, _STATE, ReferenceState.of(model))  # last: the hooks above are the model's own
    return model


def _resolve_forward_when_called(model: torch.nn.Module) -> None:
    """Make ``model.forward`` look its class's ``forward`` up on each call, inside the pristine scope.

    ``Module.__call__`` binds ``self.forward`` *before* it runs the forward pre-hooks, so the hook
    that swaps the test's patches out comes too late for the top-level class's own ``forward``:
    a patch of ``LlamaForCausalLM.forward`` (Liger's fused linear-cross-entropy) ran on the
    reference, and a wrong loss compared equal with itself. Submodules' forwards are bound when
    called, inside the scope, so only the root needs this. The instance attribute enters the
    scope itself too (re-entrant), so ``reference.forward(...)`` called directly runs pristine.
    An instance ``forward`` already set (accelerate's dispatch hooks) was bound in the pristine
    world, at build time, and is left alone.
    """
    if "forward" in vars(model):
        return
    original = type(model).forward

    @functools.wraps(original)  # generate() and exporters read the signature of model.forward
    def forward(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        with running_pristine():
            return type(self).forward(self, *args, **kwargs)

    # bound with MethodType, not a closure over ``model``: a deep copy (a float64 oracle) calls its own forward
    model.forward = types.MethodType(forward, model)


def reference_problems(model: torch.nn.Module) -> list[str]:
    """What leaked into a prepared reference (checked in the pristine world); ``[]`` when it is pristine."""
    record = getattr(model, _RECORD, None)
    if record is None:
        return []
    with pristine():
        return record.problems(model)


def reference_changes(model: torch.nn.Module) -> ReferenceChanges:
    """What was changed in a prepared reference since it was built (hooks, modules, modes, weights); empty if nothing."""
    state = getattr(model, _STATE, None)
    return state.changes(model) if state is not None else ReferenceChanges()


def _message(model: torch.nn.Module, problems: list[str]) -> str:
    shown = "\n".join(f"  {p}" for p in problems[:10])
    more = f"\n  ... and {len(problems) - 10} more" if len(problems) > 10 else ""
    return (
        f"the reference {type(model).__name__} is not the unpatched model any more, so comparing with it would "
        f"prove nothing:\n{shown}{more}\nPatches that rebind transformers' classes must go through "
        "@pytest.mark.patch(methods=..., context=...) or patch_registry, which keep them out of the reference; "
        "do not modify reference_model itself."
    )
