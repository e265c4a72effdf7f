"""Tied parameters: one tensor under several names, as ``tie_word_embeddings`` ties ``lm_head`` to the embeddings.

A patch that unties them (a copy instead of the shared tensor) computes the same outputs at first
and trains apart: the two copies drift, and a merge or a reload ties them again, to nonsense
(PEFT's ``modules_to_save``, issue #2777). Comparing the groups of names that share a tensor is
cheap (one walk of ``named_parameters``), so it runs before any training step.
"""

from __future__ import annotations

import torch

from pytest_modelpatch.compare._engine.devices import unwrapped


def tied_groups(model: torch.nn.Module) -> list[tuple[str, ...]]:
    """Every group of parameter names that share one tensor, in ``named_parameters`` order.

    Example: ``tied_groups(model) == [("model.embed_tokens.weight", "lm_head.weight")]`` when tied.
    """
    names: dict[int, list[str]] = {}
    for name, param in unwrapped(model).named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    return [tuple(group) for group in names.values() if len(group) > 1]


def _parameter(model: torch.nn.Module, name: str) -> torch.nn.Parameter | None:
    try:
        return unwrapped(model).get_parameter(name)
    except AttributeError:
        return None


def tie_differences(reference: torch.nn.Module, patched: torch.nn.Module) -> list[str]:
    """What the patched model ties differently from the reference, one line per group; empty when alike."""
    found = []
    for group in tied_groups(reference):
        params = [_parameter(patched, name) for name in group]
        if any(p is None for p in params):
            continue  # a name the patch renamed: the weight names lint and the gradients say so
        if len({id(p) for p in params}) > 1:
            found.append(
                f"the reference ties {' and '.join(group)} (one tensor); the patched model holds separate tensors, "
                "which train apart and are tied again, to one of them, when the model is saved and reloaded"
            )
    reference_groups = {frozenset(group) for group in tied_groups(reference)}
    for group in tied_groups(patched):
        if frozenset(group) not in reference_groups and all(_parameter(reference, name) is not None for name in group):
            found.append(f"the patched model ties {' and '.join(group)} (one tensor); the reference does not")
    return found
