"""Which families a sweep runs: every family, or every family a patch reaches.

``@pytest.mark.model(families="patched")`` runs a test once per family whose tiny model holds a
class the test's patches replace, counting composite models through their towers (LLaVA through
its Llama text model, PaliGemma through Gemma). The lint's scan index says which modeling modules
bind each class a key matches, as ``apply_patches`` would find them, and a table of each family's
towers (the model types its tiny config is built from) says which families run those modules. The
table costs one ``tiny_config`` per family, so it is cached on disk beside the scan index, keyed by
the transformers version and the catalog's sources. A modeling module may define a class it never
builds (Qwen2.5-VL's vision tower copies ``Qwen2MLP``), so each family so found is then built on
the meta device (milliseconds) and kept only when its model holds a class a key replaces; the keys
it holds are the ones that apply to it, which the sweep's registration lint and load check follow.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import re
from collections.abc import Iterable
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from pytest_modelpatch.errors import PatchUsageError
from pytest_modelpatch.families.not_running import NEEDS_TIMM, NOT_RUNNING
from pytest_modelpatch.lint.scan_index import CORE, cache_dir, load_index, write_atomically

SWEEPS = ("patched", "all")
TOWERS_FORMAT = 1


@dataclass(frozen=True)
class SweepFamily:
    """One family of a sweep, and why it is skipped here ("" when it runs)."""

    model_type: str
    skip: str = ""


def sweep_families(sweep: str, keys: Iterable[str] = (), *, may_match_nothing: Iterable[str] = ()) -> list[SweepFamily]:
    """The families ``families=sweep`` runs: ``"all"``, or ``"patched"`` for the classes ``keys`` match.

    A key that replaces a class in none of the swept families is a usage error, unless it is in
    ``may_match_nothing`` (the test allows its ``NO_MATCH``).

    Example: ``[f.model_type for f in sweep_families("patched", ["^(Llama|Gemma)RMSNorm$"])]``
    holds ``llama``, ``gemma``, ``llava`` and ``paligemma``.
    """
    if sweep not in SWEEPS:
        raise PatchUsageError(
            f"families={sweep!r}: a sweep is one of {', '.join(map(repr, SWEEPS))}, or a list of model types"
        )
    towers = family_towers()
    if sweep == "all":
        chosen = list(towers)
    else:
        keys = list(keys)
        if not keys:
            raise PatchUsageError(
                'families="patched" sweeps the families the test\'s patches reach, and this test has no class mapping '
                "or method patch: add @pytest.mark.patch({...}), or name the families: @pytest.mark.model(['llama', ...])."
            )
        reached = patched_model_types(keys)
        found = [family for family, built_from in towers.items() if reached.intersection(built_from or [family])]
        # a family that cannot be built here stays, to be skipped with its reason
        applying = {family: keys_in_family(keys, family) if towers[family] is not None else set(keys)
                    for family in found}  # fmt: skip
        chosen = [family for family in found if applying[family]]
        if not chosen:
            raise PatchUsageError(
                f'families="patched": the keys {keys} replace no class of any family in transformers '
                f"{metadata.version('transformers')}; run `modelpatch lint` on them to see why."
            )
        _refuse_keys_reaching_nothing(keys, [applying[family] for family in chosen], set(may_match_nothing))
    return [SweepFamily(family, skip_reason(family, towers[family])) for family in chosen]


def _refuse_keys_reaching_nothing(keys: list[str], applying: list[set[str]], allowed: set[str]) -> None:
    """A key that replaces nothing in any swept family is a typo or a stale name, as it is alone."""
    reached = set().union(*applying)
    idle = [key for key in keys if key not in reached and key not in allowed]
    if idle:
        example = f"allow={{{idle[0]!r}: ['NO_MATCH']}}"
        raise PatchUsageError(
            f'families="patched": {", ".join(map(repr, idle))} replace(s) no class of any family this sweep runs '
            f"(the tiny models as built on the meta device), while the other keys do. Fix the key, drop it, or accept "
            f"that it replaces nothing: @pytest.mark.patch(..., {example})."
        )


def keys_in_family(keys: Iterable[str], model_type: str) -> set[str]:
    """Which of ``keys`` replace a class of ``model_type``'s tiny model as built on the meta device.

    Every key when the model cannot be built: the load then checks them as it would alone.

    Example: ``keys_in_family(["^Qwen2RMSNorm$", "^Qwen2MLP$"], "qwen2_vl")`` is ``{"^Qwen2MLP$"}``.
    """
    from pytest_modelpatch.models.builder import keys_used

    keys = list(keys)
    names = built_class_names(model_type)
    return set(keys) if names is None else keys_used(keys, set(names))


@functools.cache  # one meta build per family a process: every swept item asks again at setup
def built_class_names(model_type: str) -> frozenset[str] | None:
    """The module class names of ``model_type``'s tiny base model built on the meta device; None if it cannot be."""
    import warnings

    from transformers.utils import logging as transformers_logging

    from pytest_modelpatch.lint.model_structures import meta_structures

    verbosity = transformers_logging.get_verbosity()
    transformers_logging.set_verbosity_error()  # tiny configs warn about rope keys and token ids
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            _, built = meta_structures(model_type, {}, original=False)  # no swaps: the original classes
    except Exception:  # noqa: BLE001 - the test's own load shows why, with the family's error
        return None
    finally:
        transformers_logging.set_verbosity(verbosity)
    return frozenset(built.modules.values())


def patched_model_types(keys: Iterable[str]) -> set[str]:
    """The model types whose modeling modules bind a class that one of ``keys`` replaces."""
    from pytest_modelpatch.lint.patterns import matched_classes

    index = load_index()
    folders = {
        index.modules[module][0]
        for classes in matched_classes(list(keys), index=index).values()
        for modules in classes.values()
        for module in modules
    }
    folders.discard(CORE)
    return {model_type for model_type, folder in index.model_types.items() if folder in folders}


def skip_reason(family: str, built_from: list[str] | None) -> str:
    """Why ``family`` does not run here: the documented reason, or the tiny config's error; "" when it runs."""
    if family in NOT_RUNNING:
        stage, why = NOT_RUNNING[family]
        return f"{family} does not run here ({stage}): {why}"
    if family in NEEDS_TIMM and importlib.util.find_spec("timm") is None:
        stage, why = NEEDS_TIMM[family]
        return f"{family} needs timm ({stage}): {why}"
    if built_from is None:
        return f"{family} has no tiny config here: see `python benchmarks/model_coverage.py {family}`"
    return ""


@functools.cache  # read once a process: every swept test asks at collection, and the answer cannot change
def family_towers() -> dict[str, list[str] | None]:
    """Every family -> the model types its tiny model is built from (itself first); None where none builds."""
    path = _towers_path()
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        if data.get("format") == TOWERS_FORMAT:
            return data["towers"]
    except (OSError, ValueError, AttributeError):
        pass
    towers = _build_towers()
    write_atomically(path, {"format": TOWERS_FORMAT, "towers": towers})
    return towers


def _build_towers() -> dict[str, list[str] | None]:
    import warnings

    from transformers.utils import logging as transformers_logging

    from pytest_modelpatch.families.catalog import available_model_types, tiny_config
    from pytest_modelpatch.models.specs import config_families

    towers: dict[str, list[str] | None] = {}
    verbosity = transformers_logging.get_verbosity()
    transformers_logging.set_verbosity_error()  # tiny vocabularies make some configs warn about token ids
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for family in available_model_types():
                try:
                    towers[family] = config_families(tiny_config(family))
                except Exception:  # noqa: BLE001 - a family whose config cannot be made tiny here: skipped, with why
                    towers[family] = None
    finally:
        transformers_logging.set_verbosity(verbosity)
    return towers


def _towers_path() -> Path:
    # the towers follow from transformers and from the catalog's shrinking rules: a change to either rebuilds
    catalog = Path(__file__).resolve().parent.parent / "families"
    digest = hashlib.sha256(f"{TOWERS_FORMAT}|{metadata.version('transformers')}".encode())
    for source in sorted(catalog.rglob("*.py")):
        digest.update(source.read_bytes())
    version = re.sub(r"[^\w.]", "_", metadata.version("transformers"))
    return cache_dir() / f"family-towers-transformers-{version}-{digest.hexdigest()[:16]}.json"
