"""Registration-time check that every weight conversion can be reversed at save time.

``save_pretrained`` writes the original checkpoint layout by reversing each
registered ``WeightConverter``: every operation's ``reverse_op``, in reverse
order (transformers 5.x, ``WeightTransform.reverse_transform``). A custom
``ConversionOps`` without one fails only when someone saves; this module finds it
when the conversion is registered.

Example::

    assert_reversible({"llama": [WeightConverter(["q_proj", "k_proj", "v_proj"], "qkv_proj", [MyFuse()])]})
    # AssertionError: conversion 'llama' [0] ... operation MyFuse has no reverse_op ...
    # (registering it is refused the same way: require_reversible's PatchUsageError)
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

from transformers.core_model_loading import ConversionOps, WeightTransform

from pytest_modelpatch.errors import PatchUsageError


@dataclass(frozen=True)
class ReversibilityProblem:
    """One conversion that ``save_pretrained`` could not reverse, and why."""

    key: str
    index: int
    converter: str
    operation: str
    reason: str

    def __str__(self) -> str:
        where = f"conversion {self.key!r} [{self.index}] {self.converter}"
        if self.operation:
            where += f", operation {self.operation}"
        return f"{where}: {self.reason}"


def reversibility_problems(conversions: dict[str, list[Any]]) -> list[ReversibilityProblem]:
    """Every problem that would stop ``save_pretrained`` from reversing ``conversions``; empty if none.

    Example::

        assert reversibility_problems({"llama": [fused_qkv_converter()]}) == []  # assert_reversible raises them
    """
    problems: list[ReversibilityProblem] = []
    for key, transforms in conversions.items():
        for index, transform in enumerate(transforms):
            problems += _transform_problems(key, index, transform)
    return problems


def assert_reversible(conversions: dict[str, list[Any]]) -> None:
    """Fail (``AssertionError``) listing every conversion operation without a usable reverse
    (``reversibility_problems``), as every ``assert_*`` check fails.

    Example::

        assert_reversible({"llama": [fused_qkv_converter()]})  # the conversions a patch registers
    """
    __tracebackhide__ = True
    problems = reversibility_problems(conversions)
    if problems:
        raise AssertionError(_irreversible_message(problems))


def require_reversible(conversions: dict[str, list[Any]]) -> None:
    """Refuse (``PatchUsageError``) conversions about to be registered that cannot be reversed at save time."""
    problems = reversibility_problems(conversions)
    if problems:
        raise PatchUsageError(_irreversible_message(problems))


def _irreversible_message(problems: list[ReversibilityProblem]) -> str:
    listed = "\n  ".join(str(problem) for problem in problems)
    return (
        f"{len(problems)} weight conversion(s) cannot be reversed, so save_pretrained would fail or write "
        f"a different checkpoint:\n  {listed}\n"
        "Give each custom ConversionOps a `reverse_op` property returning the ConversionOps that undoes it "
        "(e.g. Concatenate <-> Chunk), or drop the conversion and save with save_original_format=False."
    )


def _transform_problems(key: str, index: int, transform: Any) -> list[ReversibilityProblem]:
    described = _describe(transform)
    if not isinstance(transform, WeightTransform):
        return []  # the registration validator reports wrong types; only reversibility is judged here
    problems = [
        ReversibilityProblem(key, index, described, _op_name(op), reason)
        for op in getattr(transform, "operations", None) or []
        if (reason := _operation_problem(op)) is not None
    ]
    if problems:
        return problems
    try:
        reverse = transform.reverse_transform()
    except Exception as exc:  # noqa: BLE001 - transformers raises ValueError, custom ops anything
        return [ReversibilityProblem(key, index, described, "", f"reverse_transform() raised {_exception(exc)}")]
    # The reverse must itself reverse (save -> load of a patched-layout checkpoint goes both ways).
    for op in getattr(reverse, "operations", None) or []:
        reason = _operation_problem(op, label="its reverse")
        if reason is not None:
            return [ReversibilityProblem(key, index, described, _op_name(op), reason)]
    return []


def _operation_problem(op: Any, label: str = "") -> str | None:
    prefix = f"{label} " if label else ""
    if not isinstance(op, ConversionOps):
        return f"{prefix}is {type(op).__name__}, not a transformers ConversionOps"
    try:
        reverse = op.reverse_op
    except NotImplementedError:
        return f"{prefix}has no reverse_op (ConversionOps.reverse_op raises NotImplementedError)"
    except Exception as exc:  # noqa: BLE001 - a custom op may raise anything: it is reported
        return f"{prefix}reverse_op raised {_exception(exc)}"
    if not isinstance(reverse, ConversionOps):
        return f"{prefix}reverse_op returned {type(reverse).__name__}, not a ConversionOps"
    if inspect.isabstract(type(reverse)):
        return f"{prefix}reverse_op returned abstract {type(reverse).__name__} (no convert())"
    return None


def _op_name(op: Any) -> str:
    return type(op).__name__


def _describe(transform: Any) -> str:
    sources = getattr(transform, "_original_source_patterns", None) or getattr(transform, "source_patterns", "?")
    targets = getattr(transform, "_original_target_patterns", None) or getattr(transform, "target_patterns", "?")
    return f"{type(transform).__name__}({sources} -> {targets})"


def _exception(exc: Exception) -> str:
    return f"{type(exc).__name__}: {exc}"
