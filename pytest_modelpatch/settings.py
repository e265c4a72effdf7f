"""The session's settings and the table of implementation axes: what every room reads, at the bottom.

:data:`SETTINGS` holds what the pytest session decides for every check and load (the seed property
checks draw from, whether forwards are timed, whether internal loads print, whether cached checkpoints
are hashed): ``plugin.py`` writes it once in ``pytest_configure`` and models/ and compare/ read it.
:data:`IMPLEMENTATION_AXES` is the one table of the implementations a model loads with. Like
``errors``, this module imports nothing of the package, so every room may import it.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, fields
from typing import Any, NamedTuple


@dataclass
class CheckSettings:
    """What the pytest session decides for every check and load; a check's own arguments win over these."""

    seed: int | None = None  # property checks' seed when a call passes none (--modelpatch-seed)
    timing: bool = False  # --modelpatch-timing: time both models' forwards beside each forward check
    verbose_loads: bool = False  # pytest -v: let transformers' bars and load reports of internal loads through
    full_verification: bool = False  # --modelpatch-verify-cache: hash every file of a cached checkpoint on use


SETTINGS = CheckSettings()


def configure_checks(**changes: Any) -> dict[str, Any]:
    """Change :data:`SETTINGS` (its fields by name, e.g. ``seed=``, ``timing=``); returns the values replaced, to restore.

    Example: ``previous = configure_checks(seed=1234)`` ... ``configure_checks(**previous)``.
    """
    known = {f.name for f in fields(CheckSettings)}
    unknown = sorted(set(changes) - known)
    if unknown:
        raise TypeError(f"configure_checks: unknown settings {unknown}; known: {sorted(known)}")
    previous = {name: getattr(SETTINGS, name) for name in changes}
    for name, value in changes.items():
        setattr(SETTINGS, name, value)
    return previous


class ImplementationAxis(NamedTuple):
    """One implementation a model is loaded with: its name in reports, its keyword, its config attribute."""

    name: str  # as report lines show it: "attention"
    keyword: str  # from_pretrained's keyword, and the patch and model markers': "attn_implementation"
    attribute: str  # where a loaded model's config records it: "_attn_implementation"


# The one table of implementation axes: the markers' keywords and help, the builder's eager
# reference and the report's lines derive from it.
IMPLEMENTATION_AXES = (
    ImplementationAxis("attention", "attn_implementation", "_attn_implementation"),
    ImplementationAxis("experts", "experts_implementation", "_experts_implementation"),
)
IMPLEMENTATION_KEYWORDS = tuple(axis.keyword for axis in IMPLEMENTATION_AXES)


def implementations_of(model: Any) -> dict[str, str]:
    """The attention and experts implementations ``model`` was loaded with, by axis, each tower's too.

    The top config's under the axis, each sub-config's (a composite model's towers, nested ones
    dotted) under ``axis.path``: ``{"attention": "sdpa", "attention.text_config": "sdpa",
    "attention.vision_config": "sdpa"}``. A tower left on another implementation shows.
    """
    found = {}
    for path, level in _config_levels(getattr(model, "config", None)):
        for axis, _, attribute in IMPLEMENTATION_AXES:
            name = getattr(level, attribute, None)
            if name is not None:
                found[f"{axis}.{path}" if path else axis] = str(name)
    return found


def _config_levels(config: Any, path: str = "") -> Iterator[tuple[str, Any]]:
    """``(path, config)`` for a config and every sub-config below it (``sub_configs``, transformers 5.x)."""
    if config is None:
        return
    yield path, config
    for key in getattr(config, "sub_configs", None) or {}:
        sub = getattr(config, key, None)
        if sub is not None and sub is not config and path.count(".") < 4:  # towers of towers at most a few deep
            yield from _config_levels(sub, f"{path}.{key}" if path else key)


def describe_implementations(found: dict[str, str], axis: str) -> str:
    """One side's choice on ``axis`` as a line shows it: ``sdpa``, or ``sdpa (vision_config: eager)`` where towers differ."""
    top = found.get(axis)
    towers = [
        f"{key.partition('.')[2]}: {name}" for key, name in found.items() if key.startswith(f"{axis}.") and name != top
    ]
    return f"{top} ({', '.join(towers)})" if towers else str(top)
