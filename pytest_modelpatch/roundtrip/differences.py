"""What differs between a round-trip's source and its saved copy, beyond the tensors' bytes.

The forward passes of the reference and of the reloaded copy, compared bit for bit (a round-trip
must give the same model back, so no tolerance applies), and the keys of ``config.json`` that
the round-trip changed. The tensors themselves are diffed by :mod:`.safetensors_diff`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pytest_modelpatch.compare._engine.devices import evaluating
from pytest_modelpatch.compare._engine.outputs import flatten_outputs
from pytest_modelpatch.compare._engine.running import forward

# config.json keys that save_pretrained rewrites on every save; a change there says nothing about the patch
_VOLATILE_CONFIG_KEYS = frozenset({"transformers_version", "_name_or_path", "name_or_path"})


@dataclass
class OutputDiff:
    """One output tensor of the reference model against the same output after the round-trip.

    ``name`` is the tensor's path in the output tree, as ``compare._engine.outputs.flatten_outputs``
    names it (``logits``, ``hidden_states[1]``, ``cache.layers[0].keys``).
    """

    name: str
    identical: bool
    max_abs_diff: float
    shape: tuple[int, ...] = ()

    def __str__(self) -> str:
        if self.identical:
            return f"{self.name}: identical"
        return f"{self.name}{list(self.shape)}: max abs diff {self.max_abs_diff:.3g}"


def output_leaves(model: torch.nn.Module, inputs: Mapping[str, Any]) -> dict[str, Any]:
    """One forward pass, run and flattened as every check runs it (``compare._engine.running``, ``compare._engine.outputs``): ``path -> leaf``.

    ``forward`` seeds the pass, so a model that draws in eval mode (ViT-MAE's masking) draws
    the same before and after the round-trip; nested outputs and cache layers are kept.
    """
    with evaluating(model):
        return dict(flatten_outputs(forward(model, inputs)))


def identical_outputs(reference: Mapping[str, Any], actual: Mapping[str, Any]) -> list[OutputDiff]:
    """Bit-for-bit comparison of two flattened forward passes, one row per tensor path.

    A round-trip must give the same model back, so no tolerance applies: a tensor is identical
    only at the same shape and dtype with ``torch.equal``; one on a single side differs.
    Non-tensor leaves (``None``, scalars) are not rows.
    """
    rows = []
    for path in [*reference, *(p for p in actual if p not in reference)]:
        expected, got = reference.get(path), actual.get(path)
        if not isinstance(expected, torch.Tensor):
            if isinstance(got, torch.Tensor):
                rows.append(OutputDiff(path, False, float("inf"), tuple(got.shape)))
            continue
        if not isinstance(got, torch.Tensor) or got.shape != expected.shape or got.dtype != expected.dtype:
            rows.append(OutputDiff(path, False, float("inf"), tuple(expected.shape)))
            continue
        same = torch.equal(expected, got)
        diff = 0.0 if same else float((expected.double() - got.double()).abs().max())
        rows.append(OutputDiff(path, same, diff, tuple(expected.shape)))
    return rows


def config_changes(source: Path, saved: Path) -> list[str]:
    """Keys of config.json that the round-trip added, removed or changed (informational)."""
    try:
        before = json.loads((source / "config.json").read_text(encoding="utf-8"))
        after = json.loads((saved / "config.json").read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return []
    return _dict_changes(before, after, "")


def _dict_changes(before: dict[str, Any], after: dict[str, Any], prefix: str) -> list[str]:
    found = []
    for key in sorted((before.keys() | after.keys()) - _VOLATILE_CONFIG_KEYS):
        name = f"{prefix}{key}"
        if key not in after:
            found.append(f"{name!r} removed (was {before[key]!r})")
        elif key not in before:
            found.append(f"{name!r} added: {after[key]!r}")
        elif isinstance(before[key], dict) and isinstance(after[key], dict):
            found += _dict_changes(before[key], after[key], f"{name}.")
        elif before[key] != after[key]:
            found.append(f"{name!r}: {after[key]!r} (was {before[key]!r})")
    return found
