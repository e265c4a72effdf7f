"""What a shared reference model holds (hooks, modules, parameters, buffers, modes), to say what a test changed in it.

A session-cached reference is handed to many tests. A hook one test leaves on it, a weight it
edits in place, a parameter it swaps or a mode it leaves flipped would make the next test's
correct patch fail, blamed on that patch. :meth:`ReferenceState.of` records the model as it was
built; :meth:`ReferenceState.changes` says what differs now, naming the module, the hook or the
parameter. Values are compared by checksums of each tensor's bits, summed on its device, and by
each tensor's norm to say by how much; nothing is copied, whatever the model's size.
"""

from __future__ import annotations

import operator
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

# each hook table of nn.Module, with what its hooks are called in a message
HOOK_TABLES = {
    "_forward_hooks": "forward hook",
    "_forward_pre_hooks": "forward pre-hook",
    "_backward_hooks": "backward hook",
    "_backward_pre_hooks": "backward pre-hook",
    "_state_dict_hooks": "state-dict hook",
    "_state_dict_pre_hooks": "state-dict pre-hook",
    "_load_state_dict_pre_hooks": "load-state-dict pre-hook",
    "_load_state_dict_post_hooks": "load-state-dict post-hook",
}

FIXES = {
    "hook": "remove a hook before the test ends with the handle its register_*_hook call returned "
    "(handle = module.register_forward_hook(fn) ... handle.remove()), or hook a model of the test's own",
    "mode": "put the mode back with reference_model.eval() (the checks that train it put it back themselves)",
    "model": "to change the model, change one of the test's own: model_builder.patched(request, unpatched=True) "
    "loads a fresh one, copy.deepcopy(reference_model) copies it",
}
GROUPED = 3  # more than this many tensors or modules with the same change are said in one line


@dataclass(frozen=True)
class Change:
    """One thing a test changed in a shared reference: where, what, and which of :data:`FIXES` applies."""

    where: str  # a module, parameter or buffer name ("" is the model itself)
    what: str
    fix: str

    def __str__(self) -> str:
        return f"{self.where or '<the model itself>'}: {self.what}"


@dataclass
class ReferenceChanges:
    """What :meth:`ReferenceState.changes` found: the test's changes, and whether the model changed its own derived state."""

    changes: list[Change] = field(default_factory=list)
    derived: bool = False  # a buffer the model's own forward re-derives (dynamic RoPE): rebuild, blame no one

    def __bool__(self) -> bool:
        return bool(self.changes) or self.derived

    def __str__(self) -> str:
        lines = _grouped(self.changes)
        shown = "\n".join(f"  {line}" for line in lines[:12])
        more = f"\n  ... and {len(lines) - 12} more" if len(lines) > 12 else ""
        fixes = "\n".join(f"  - {FIXES[fix]}" for fix in dict.fromkeys(c.fix for c in self.changes))
        return (
            "reference_model is shared by the session's tests, and this test left it changed:\n"
            f"{shown}{more}\nThe next test would have compared its patch with this changed model; it gets a "
            f"freshly built one instead. To fix it:\n{fixes}"
        )


def _grouped(changes: list[Change]) -> list[str]:
    """One line a change; the same change to many tensors or modules (a whole-model .to(), .train()) in one line."""
    by_what: dict[str, list[str]] = {}
    for change in changes:
        by_what.setdefault(change.what, []).append(change.where or "<the model itself>")
    lines = []
    for what, where in by_what.items():
        if len(where) > GROUPED:
            lines.append(f"{what}: {len(where)} of them ({', '.join(where[:GROUPED])}, ...)")
        else:
            lines += [f"{w}: {what}" for w in where]
    return lines


@dataclass(frozen=True)
class _Tensor:
    """A parameter or buffer as built: the object, its properties, a hash of its bytes and its norm."""

    tensor: torch.Tensor
    dtype: torch.dtype
    shape: tuple[int, ...]
    device: torch.device
    requires_grad: bool
    digest: tuple[int, ...] | None
    norm: float
    tensor_hooks: int

    @classmethod
    def of(cls, tensor: torch.Tensor) -> _Tensor:
        return cls(
            tensor, tensor.dtype, tuple(tensor.shape), tensor.device, tensor.requires_grad, _digest(tensor),
            _norm(tensor), _tensor_hooks(tensor),
        )  # fmt: skip

    def changes(self, now: torch.Tensor) -> list[str]:
        """How ``now`` differs: its properties, else its values (changed in place when it is the same object)."""
        found = [
            f"{what} {before} -> {after}"
            for what, before, after in (
                ("dtype", self.dtype, now.dtype), ("shape", self.shape, tuple(now.shape)),
                ("device", self.device, now.device), ("requires_grad", self.requires_grad, now.requires_grad),
            )
            if before != after
        ]  # fmt: skip
        if _tensor_hooks(now) > self.tensor_hooks:
            found.append("a tensor hook (register_hook) was left on it")
        if not any(f.startswith(("dtype", "shape", "device")) for f in found) and _digest(now) != self.digest:
            how = "in place " if now is self.tensor else ""
            found.append(f"values changed {how}({self.by_how_much(now)})")
        return found

    def by_how_much(self, now: torch.Tensor) -> str:
        after = _norm(now)
        if _digest(now) == self.digest:
            return "the same values"
        if after == self.norm:
            return f"norm {self.norm:.4g} as before: values moved or swapped"
        ratio = f", x{after / self.norm:.3g}" if self.norm else ""
        return f"norm {self.norm:.4g} -> {after:.4g}{ratio}"


def _digest(tensor: torch.Tensor) -> tuple[int, ...] | None:
    """Checksums of the tensor's bytes (``None`` where there are none to read: meta, sparse).

    Its bytes read as 64-bit integers, summed (wrapping) in three interleaved columns on the
    tensor's own device: exact (one flipped bit shows), most moves show, and nothing is copied,
    where hashing the bytes copied a GPU model to the host for every test (a 7B model's 14 GB).
    About 8 GB/s on one CPU core, against 0.6 for the hash.
    """
    try:
        raw = tensor.detach().reshape(-1).view(torch.uint8)
        if raw.is_meta or raw.is_sparse:
            return None
        whole = raw.numel() // 24 * 24
        try:
            words = raw[:whole].view(torch.int64)
        except RuntimeError:  # a view whose storage offset is not 8-byte aligned
            words = raw[:whole].to(torch.int64)
        sums = torch.cat([words.view(-1, 3).sum(0), raw[whole:].to(torch.int64).sum().reshape(1)])
        return (raw.numel(), *sums.tolist())
    except (RuntimeError, TypeError, NotImplementedError):
        return None


def _norm(tensor: torch.Tensor) -> float:
    try:
        return float(tensor.detach().double().norm()) if tensor.is_floating_point() else 0.0
    except (RuntimeError, NotImplementedError):
        return 0.0


def _tensor_hooks(tensor: torch.Tensor) -> int:
    return len(getattr(tensor, "_backward_hooks", None) or {}) + len(
        getattr(tensor, "_post_accumulate_grad_hooks", None) or {}
    )


@dataclass(frozen=True)
class _Module:
    """A module as built: the object (``None`` for the model itself), its class, its mode and its hooks."""

    module: torch.nn.Module | None
    cls: type
    training: bool
    hooks: dict[str, dict[int, str]]  # hook table -> handle id -> what the hook is, for a message

    @classmethod
    def of(cls, module: torch.nn.Module, root: bool) -> _Module:
        return cls(None if root else module, type(module), module.training, _hooks(module))


def _hooks(module: torch.nn.Module) -> dict[str, dict[int, str]]:
    return {table: {i: _describe(module, table, i) for i in getattr(module, table, {})} for table in HOOK_TABLES}


def _describe(module: torch.nn.Module, table: str, handle: int) -> str:
    """``forward hook record (test_x.record, with_kwargs=True)``: the kind, the function's name and where it is."""
    hook = getattr(module, table)[handle]
    kind = HOOK_TABLES[table]
    if table == "_backward_hooks" and getattr(module, "_is_full_backward_hook", None):
        kind = "full backward hook"
    inner = getattr(hook, "__func__", hook)
    name = getattr(inner, "__name__", type(hook).__name__)
    where = f"{getattr(inner, '__module__', None) or '?'}.{getattr(inner, '__qualname__', name)}"
    flags = [
        flag
        for flag, extra in (("with_kwargs=True", "_with_kwargs"), ("always_call=True", "_always_called"))
        if handle in getattr(module, f"{table}{extra}", {})
    ]
    return f"{kind} {name} ({', '.join([where, *flags])})"


_HOOKS = operator.attrgetter(*HOOK_TABLES)


class _Exactly:
    """The model exactly as built, compared in a few C-level list comparisons: the fast path of every check.

    Every ``_modules`` table the same (so the same tree), the same classes, modes, hook handles,
    parameter objects, buffer names, tensor properties and bytes. Anything else, even a change
    the full comparison accepts (a model's own rewiring), is left to :meth:`ReferenceState.changes`.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.others = [m for m in model.modules() if m is not model]
        self.built = self._read(model)

    def _read(self, model: torch.nn.Module) -> list[Any]:
        modules = [model, *self.others]
        tensors = [t for m in modules for t in (*m._parameters.values(), *m._buffers.values()) if t is not None]
        return [
            [dict(m._modules) for m in modules],
            list(map(type, modules)),
            [m.training for m in modules],
            [tuple(table) for m in modules for table in _HOOKS(m)],
            [(*m._parameters, *map(id, m._parameters.values()), *m._buffers) for m in modules],
            [(t.dtype, t.shape, t.device, t.requires_grad, _tensor_hooks(t)) for t in tensors],
            list(map(_digest, tensors)),
        ]

    def holds(self, model: torch.nn.Module) -> bool:
        try:
            return self._read(model) == self.built
        except Exception:  # noqa: BLE001 - an entry whose == raises: the full comparison looks closer
            return False


@dataclass(frozen=True)
class ReferenceState:
    """A reference model's modules, hooks, parameters and buffers as built, to name what a test changed since.

    Holds the model's submodules, parameters and buffers (their identity is part of the model),
    never the model itself: it is kept on the model, and a cycle would outlive a released model.
    """

    modules: dict[str, _Module]
    parameters: dict[str, _Tensor]
    buffers: dict[str, _Tensor]
    classes: frozenset[type]
    exactly: _Exactly

    @classmethod
    def of(cls, model: torch.nn.Module) -> ReferenceState:
        modules = {name: _Module.of(m, m is model) for name, m in model.named_modules()}
        return cls(
            modules,
            {name: _Tensor.of(p) for name, p in model.named_parameters()},
            {name: _Tensor.of(b) for name, b in model.named_buffers()},
            frozenset(m.cls for m in modules.values()),
            _Exactly(model),
        )

    def changes(self, model: torch.nn.Module) -> ReferenceChanges:
        """What differs from the build: hooks, modules, modes, parameters and buffers (``.grad`` is not compared)."""
        found = ReferenceChanges()
        if self.exactly.holds(model):
            return found
        now = dict(model.named_modules())
        replaced = self._module_changes(model, now, found)
        self._parameter_changes(dict(model.named_parameters()), replaced, found)
        self._buffer_changes(model, now, replaced, found)
        return found

    def _module_changes(
        self, model: torch.nn.Module, now: dict[str, torch.nn.Module], found: ReferenceChanges
    ) -> list[str]:
        """Hooks, modes and modules replaced, deleted or added; returns the replaced ones (their insides go unsaid)."""
        replaced: list[str] = []
        rewired: list[str] = []  # new modules the model made itself: modules may come and go inside them
        for name, was in self.modules.items():  # parents first
            module = now.get(name)
            if _under(name, replaced) or (module is None and _under(name, rewired)):
                continue
            if module is None:
                found.changes.append(Change(name, "was deleted", "model"))
                continue
            same = module is (model if was.module is None else was.module)
            if not same and not self._own_rewiring(name, module):
                found.changes.append(Change(name, f"was replaced by another {type(module).__qualname__}", "model"))
                replaced.append(name)
                continue
            rewired += [] if same else [name]
            if same and type(module) is not was.cls:
                change = f"its class was changed from {was.cls.__qualname__} to {type(module).__qualname__}"
                found.changes.append(Change(name, change, "model"))
            if module.training != was.training:
                mode = "train" if module.training else "eval"
                change = f"left in {mode} mode (built in {'train' if was.training else 'eval'} mode)"
                found.changes.append(Change(name, change, "mode"))
            # a module the model made itself starts with no hooks: any on it now are the test's
            built = was.hooks if same else {table: {} for table in HOOK_TABLES}
            found.changes += _hook_changes(name, module, built)
        for name in now.keys() - self.modules.keys():
            if not _under(name, replaced) and not _under(name, rewired):
                found.changes.append(Change(name, f"was added (a {type(now[name]).__qualname__})", "model"))
        return replaced

    def _own_rewiring(self, name: str, module: torch.nn.Module) -> bool:
        """A new module the model made itself in its forward, holding the very parameters the old one held.

        BigBird swaps its block-sparse attention for full attention on short inputs
        (``set_attention_type``, transformers 5.x), moving the query, key and value projections
        into a module of another class of its own modeling file.
        """
        files = {c.__module__ for c in self.classes if c.__module__.startswith("transformers.")}
        if type(module) not in self.classes and not defined_in(type(module), files):
            return False
        mine = {f"{name}.{n}": p for n, p in module.named_parameters()}
        built = {n: t.tensor for n, t in self.parameters.items() if n.startswith(f"{name}.")}
        return mine.keys() == built.keys() and all(mine[n] is built[n] for n in mine)

    def _parameter_changes(
        self, now: dict[str, torch.nn.Parameter], replaced: list[str], found: ReferenceChanges
    ) -> None:
        for name, was in self.parameters.items():
            if _under(name, replaced):
                continue
            param = now.get(name)
            if param is None:
                found.changes.append(Change(name, "was deleted", "model"))
            elif param is not was.tensor:
                how = was.by_how_much(param) if param.shape == was.shape else f"shape {tuple(param.shape)}"
                change = f"was replaced by another {type(param).__name__} ({how})"
                found.changes.append(Change(name, change, "model"))
            else:
                found.changes += [Change(name, change, _fix(change)) for change in was.changes(param)]
        for name in sorted(now.keys() - self.parameters.keys()):
            if not _under(name, replaced):
                found.changes.append(Change(name, "is a parameter the model was not built with", "model"))

    def _buffer_changes(
        self, model: torch.nn.Module, modules: dict[str, torch.nn.Module], replaced: list[str], found: ReferenceChanges
    ) -> None:
        now = dict(model.named_buffers())
        for name, was in self.buffers.items():
            if _under(name, replaced):
                continue
            buffer, (owner_name, _, attr) = now.get(name), name.rpartition(".")
            owner = modules.get(owner_name)
            if buffer is None:
                found.changes.append(Change(name, "was deleted", "model"))
                continue
            # a buffer's identity is not the model's (a .to() replaces it): its properties and values are
            changes = was.changes(buffer)
            if changes and owner is not None and _derives(owner, attr, buffer, was):
                found.derived = True
            else:
                found.changes += [Change(name, change, _fix(change)) for change in changes]


def _fix(change: str) -> str:
    return "hook" if "hook" in change else "model"


def _hook_changes(name: str, module: torch.nn.Module, built: dict[str, dict[int, str]]) -> list[Change]:
    found = []
    for table, hooks in built.items():
        live = getattr(module, table, None) or {}
        found += [
            Change(name, f"{_describe(module, table, i)} was left registered", "hook") for i in live if i not in hooks
        ]
        found += [Change(name, f"{what} was removed", "hook") for i, what in hooks.items() if i not in live]
    return found


def _derives(owner: torch.nn.Module, attr: str, buffer: torch.Tensor, was: _Tensor) -> bool:
    """A buffer the model's own forward re-derives from its input, not the test's change.

    transformers' dynamic and long-context RoPE recompute ``inv_freq`` for each input's length
    (``dynamic_rope_update``, in place for ``longrope``); sinusoidal position tables (M2M100,
    Speech2Text) grow into a new, larger non-persistent buffer for a longer input.
    """
    rope = getattr(owner, "rope_type", None)
    kinds = rope.values() if isinstance(rope, dict) else [rope]
    if any(isinstance(k, str) and ("dynamic" in k or k == "longrope") for k in kinds):
        return True
    grown = buffer is not was.tensor and tuple(buffer.shape) != was.shape
    return grown and attr in owner._non_persistent_buffers_set


def _under(name: str, prefixes: Iterable[str]) -> bool:
    return any(name == p or name.startswith(f"{p}.") for p in prefixes)


def defined_in(cls: type, files: set[str]) -> bool:
    """``cls`` is the class one of the modeling ``files`` defines under its name (not a replacement bound elsewhere)."""
    module = sys.modules.get(cls.__module__)
    return cls.__module__ in files and module is not None and getattr(module, cls.__name__, None) is cls


def clear_gradients(model: torch.nn.Module) -> None:
    """``.grad`` set back to ``None``, as built: a backward a test ran on the reference is not a change of it.

    The checks clear and restore ``.grad`` around their own runs (``training_state``); a test's
    own backward would otherwise add to the next test's gradients.
    """
    for param in model.parameters():
        param.grad = None
