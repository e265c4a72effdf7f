"""Register patches for one test, validated more strictly than transformers does.

transformers checks that a replacement is an ``nn.Module`` subclass but only logs
a warning for an invalid regex key and then ignores it; here every problem is a
``PatchUsageError`` that says how to fix it, raised before anything is registered.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from contextlib import AbstractContextManager, ExitStack
from types import MappingProxyType
from typing import Any

from pytest_modelpatch.errors import PatchUsageError
from pytest_modelpatch.isolation.guard import PatchStateGuard
from pytest_modelpatch.isolation.method_patches import apply_method_patches
from pytest_modelpatch.isolation.per_test.patch_spec import PatchSpec
from pytest_modelpatch.isolation.pristine import close_scope, open_scope


def _describe(value: Any) -> str:
    if isinstance(value, type):
        return f"{value.__module__}.{value.__qualname__}"
    return f"{type(value).__name__} {value!r}"


def validate_mapping(mapping: Any) -> dict[str, type]:
    """Check a ``{class name or regex: nn.Module subclass}`` mapping; return it as a dict.

    Example::

        validate_mapping({"LlamaAttention": MyAttention})  # ok
        validate_mapping({"(": MyAttention})  # PatchUsageError: invalid regex
    """
    from torch import nn

    if not isinstance(mapping, Mapping):
        raise PatchUsageError(
            f"a patch mapping must be a dict of {{class name or regex: replacement class}}, got {_describe(mapping)}. "
            'Example: {"LlamaAttention": MyAttention}.'
        )
    checked: dict[str, type] = {}
    for key, replacement in mapping.items():
        if not isinstance(key, str) or not key:
            raise PatchUsageError(
                f"patch key {key!r} must be a non-empty string: a class name such as 'LlamaAttention' "
                "or a regex such as '.*SelfAttention$'."
            )
        try:
            re.compile(key)
        except re.error as exc:
            raise PatchUsageError(
                f"patch key {key!r} is not a valid regex ({exc}); transformers would only log a warning and never "
                f"apply it. Fix the pattern, or match the literal name with re.escape({key!r}) = {re.escape(key)!r}."
            ) from None
        if not isinstance(replacement, type):
            hint = (
                f"pass the class itself, {type(replacement).__name__}, not an instance of it"
                if isinstance(replacement, nn.Module)
                else "pass an nn.Module subclass"
            )
            raise PatchUsageError(
                f"replacement for patch key {key!r} must be a class, got {_describe(replacement)}: {hint}."
            )
        if not issubclass(replacement, nn.Module):
            bases = ", ".join(c.__name__ for c in replacement.__mro__[1:])
            raise PatchUsageError(
                f"replacement for patch key {key!r} must subclass torch.nn.Module, but "
                f"{_describe(replacement)} inherits from {bases}. Make it an nn.Module (usually by subclassing "
                "the class it replaces)."
            )
        checked[key] = replacement
    return checked


def validate_conversions(conversions: Any) -> dict[str, list[Any]]:
    """Check a ``{model_type or class name: [WeightConverter | WeightRenaming, ...]}`` mapping."""
    if conversions is None:
        return {}
    from transformers.core_model_loading import WeightTransform

    if not isinstance(conversions, Mapping):
        raise PatchUsageError(
            "conversions must be a dict of {model_type or class name: [WeightConverter | WeightRenaming, ...]}, "
            f"got {_describe(conversions)}. Example: {{'llama': [WeightConverter(...)]}}."
        )
    checked: dict[str, list[Any]] = {}
    for key, transforms in conversions.items():
        if not isinstance(key, str) or not key:
            raise PatchUsageError(f"conversion key {key!r} must be a model type ('llama') or a model class name.")
        items = [transforms] if isinstance(transforms, WeightTransform) else transforms
        if not isinstance(items, (list, tuple)) or not all(isinstance(t, WeightTransform) for t in items):
            raise PatchUsageError(
                f"conversions[{key!r}] must be a list of WeightConverter or WeightRenaming "
                f"(from transformers.core_model_loading), got {_describe(transforms)}."
            )
        checked[key] = list(items)
    return checked


def register_patches(
    mapping: Mapping[str, type] | None = None,
    *,
    conversions: Mapping[str, list[Any]] | None = None,
    overwrite: bool = False,
    lint: Callable[[dict[str, type], dict[str, list[Any]]], None] | None = None,
) -> None:
    """Validate, then register into transformers' global registries (all or nothing)."""
    checked = validate_mapping(mapping or {})
    checked_conversions = validate_conversions(conversions)
    if lint is not None and checked:
        lint(checked, checked_conversions)  # the conversions decide whether renamed weights still load
    if checked_conversions:
        from pytest_modelpatch.isolation.reversibility import require_reversible

        require_reversible(checked_conversions)
    from transformers import monkey_patching
    from transformers.conversion_mapping import (
        get_checkpoint_conversion_mapping,
        register_checkpoint_conversion_mapping,
    )

    current = monkey_patching.get_patch_mapping()
    if not overwrite:
        taken = [k for k, v in checked.items() if k in current and current[k] is not v]
        if taken:
            raise PatchUsageError(
                f"patch key(s) {taken} are already registered (to "
                f"{', '.join(_describe(current[k]) for k in taken)}). Pass overwrite=True to replace them for this test."
            )
        builtin = [k for k in checked_conversions if get_checkpoint_conversion_mapping(k) is not None]
        if builtin:
            raise PatchUsageError(
                f"conversions for {builtin} already exist (transformers' built-in or registered earlier). "
                "Pass overwrite=True to replace them for this test; the original is restored afterwards."
            )
    monkey_patching.register_patch_mapping(checked, overwrite=True)
    for key, transforms in checked_conversions.items():
        register_checkpoint_conversion_mapping(key, transforms, overwrite=True)


class PatchRegistry:
    """Patches registered for one test; everything is restored when it ends.

    Example::

        def test_fused(patch_registry):
            patch_registry.register({"LlamaAttention": FusedAttention}, conversions={"llama": [...]})
            assert "LlamaAttention" in patch_registry.mapping
    """

    def __init__(self, *, lint: bool = True, structures: Callable[..., Any] | None = None) -> None:
        self._guard = PatchStateGuard()
        self._lint = lint
        # builds the tiny models the WEIGHT_NAMES lint compares (models/ sits above this room)
        self._structures = structures
        self._conversions: dict[str, list[Any]] = {}

    def register(
        self,
        mapping: Mapping[str, type] | None = None,
        *,
        conversions: Mapping[str, list[Any]] | None = None,
        overwrite: bool = False,
        allow: Mapping[str, list[str]] | None = None,
        families: list[str] | None = None,
    ) -> None:
        """Register ``mapping`` (and weight ``conversions``) for the rest of this test.

        The keys are linted first (``allow={key: ["CONTAINER"]}`` accepts a finding);
        ``families=["bert"]`` limits the lint to those model types.
        """
        from pytest_modelpatch.lint.patterns import lint_for_registration

        def lint(checked: dict[str, type], checked_conversions: dict[str, list[Any]]) -> None:
            lint_for_registration(
                checked,
                families=families,
                allow=allow,
                structures=self._structures,
                conversions={**self._conversions, **checked_conversions},
            )

        register_patches(mapping, conversions=conversions, overwrite=overwrite, lint=lint if self._lint else None)
        self._conversions.update(validate_conversions(conversions))

    def unregister(self, keys: Iterable[str] | str) -> None:
        """Remove patch keys registered earlier (exact keys, as registered)."""
        from transformers import monkey_patching

        keys = [keys] if isinstance(keys, str) else list(keys)
        current = monkey_patching.get_patch_mapping()
        missing = [k for k in keys if k not in current]
        if missing:
            raise PatchUsageError(
                f"cannot unregister {missing}: not in the patch mapping. Registered keys: {sorted(current)}."
            )
        monkey_patching.unregister_patch_mapping(keys)

    @property
    def mapping(self) -> Mapping[str, type]:
        """A read-only view of transformers' patch mapping as it is now."""
        from transformers import monkey_patching

        return MappingProxyType(monkey_patching.get_patch_mapping())

    @property
    def conversions(self) -> Mapping[str, list[Any]]:
        """The conversions registered through this object."""
        return MappingProxyType(self._conversions)

    def close(self) -> None:
        """Restore the global state as it was before this registry was created."""
        self._guard.restore()


class ActivePatches:
    """The patches of one test's ``patch`` marks, registered until ``close()``."""

    def __init__(
        self, spec: PatchSpec, lint: Callable[[dict[str, type], dict[str, list[Any]]], None] | None = None
    ) -> None:
        self._guard = PatchStateGuard()
        self._stack = ExitStack()
        # method and context patches rebind what the reference shares: record them so that it can run without
        self.scope = open_scope() if spec.methods or spec.contexts else None
        try:
            register_patches(spec.mapping, conversions=spec.conversions, overwrite=spec.overwrite, lint=lint)
            apply_method_patches(spec.methods, self._guard.snapshot)
            for factory, kwargs in spec.contexts:
                self._stack.enter_context(_as_context(factory, kwargs))
            if self.scope is not None:
                self.scope.settle()
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Exit context patches, then restore every global the marks touched, and what contexts left behind."""
        try:
            self._stack.close()
        finally:
            try:
                if self.scope is not None:
                    close_scope(self.scope)
                    # many kernel libraries have no undo: put back what their context left rebound
                    self.scope.settle()
                    for change in self.scope.delta.changes:
                        change.apply(change.before)
            finally:
                self._guard.restore()


def _as_context(factory: Callable[..., Any], kwargs: dict[str, Any]) -> AbstractContextManager[Any]:
    manager = factory(**kwargs)
    if not (hasattr(manager, "__enter__") and hasattr(manager, "__exit__")):
        raise PatchUsageError(
            f"@pytest.mark.patch(context={getattr(factory, '__qualname__', factory)!r}) must return a context "
            f"manager, got {type(manager).__name__}. Decorate the factory with @contextlib.contextmanager."
        )
    return manager
