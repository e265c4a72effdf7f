"""Build the reference and patched models a test asks for with ``@pytest.mark.model``.

Both go through the real path: a seeded checkpoint saved once as safetensors
(shared by xdist workers through the cache directory), then ``from_pretrained``
without patches for the reference and with the test's patches for the patched
model. Reference models are cached per session; patched models are not, since
patches differ from test to test.
"""

from __future__ import annotations

import difflib
import functools
import re
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from pytest_modelpatch.errors import PatchNotAppliedError, PatchUsageError
from pytest_modelpatch.isolation.per_test.patch_spec import IMPLEMENTATIONS
from pytest_modelpatch.isolation.pristine import current_scope, pristine
from pytest_modelpatch.models.checkpoints import (
    cached_checkpoint,
    checkpoint_model_class,
    load_pretrained,
    validate_init,
)
from pytest_modelpatch.models.devices import dtype_name, first_parameter_device, seeded_generators
from pytest_modelpatch.models.memory_cache import CacheBound, ModelCache
from pytest_modelpatch.models.reference import prepare_reference, reference_changes, reference_problems
from pytest_modelpatch.models.reference_state import clear_gradients
from pytest_modelpatch.models.specs import ModelSpec, resolve_model_spec  # fmt: skip
from pytest_modelpatch.models.usage import track_patch_usage
from pytest_modelpatch.models.weights import DEFAULT_INIT

# keywords of @pytest.mark.model that are not config attributes; anything else must be one
MARKER_KEYWORDS = ("seed", "init", "fusion_config", "transform", *IMPLEMENTATIONS)
GROUND_TRUTH = "eager"  # each axis's reference implementation: transformers' default is not (grouped_mm experts on CPU)
DTYPE_KEYWORDS = ("dtype", "torch_dtype")


@dataclass(frozen=True)
class ModelRequest:
    """What ``@pytest.mark.model`` (or ``--modelpatch-checkpoint``) asks for.

    ``overrides`` change the config of both models; ``attn_implementation`` and
    ``experts_implementation`` are passed to both models' ``from_pretrained`` (a context for
    class patches; to verify an implementation, put it on ``@pytest.mark.patch``);
    ``fusion_config`` to the patched model's only (a fusion is a patch); ``seed`` and
    ``init`` shape the seeded checkpoint's weights. ``transforms`` run on both models after they
    load, before the patch marks' own (a LoRA both sides train, which a LoRA kernel is then
    checked against), each from the generators seeded with ``seed``, so random adapter weights
    are the same on both. The spec is resolved to a config once per request (:attr:`model_spec`),
    however many loads read it.
    """

    spec: Any
    overrides: Mapping[str, Any] = field(default_factory=dict)
    seed: int = 0
    fusion_config: Mapping[str, Any] | None = None
    init: str = DEFAULT_INIT
    attn_implementation: str | None = None
    experts_implementation: str | None = None
    transforms: tuple[Callable[[Any], Any], ...] = ()

    @classmethod
    def from_marker(cls, args: tuple[Any, ...], kwargs: Mapping[str, Any], where: str) -> ModelRequest:
        """Validate the mark's arguments; wrong use is a usage error naming the fix."""
        if len(args) != 1:
            raise PatchUsageError(
                f"@pytest.mark.model on {where} takes exactly one positional spec (a model type such as 'llama', "
                f"a PretrainedConfig or a checkpoint directory), got {len(args)}."
            )
        options = dict(kwargs)
        for name in DTYPE_KEYWORDS:
            if name in options:
                raise PatchUsageError(
                    f"@pytest.mark.model on {where}: {name}={options[name]!r} is not a model override; both models' "
                    "dtype is the dtype fixture's. Use @pytest.mark.dtypes('bfloat16') and the dtype fixture instead."
                )
        seed = options.pop("seed", 0)
        fusion = options.pop("fusion_config", None)
        chosen = {axis: options.pop(axis, None) for axis in IMPLEMENTATIONS}
        transforms = options.pop("transform", None) or ()
        transforms = tuple(transforms) if isinstance(transforms, (list, tuple)) else (transforms,)
        for transform in transforms:
            if not callable(transform):
                raise PatchUsageError(
                    f"@pytest.mark.model on {where}: transform must be a callable fn(model) returning a model or None "
                    f"(applied to both models after they load), got {transform!r}."
                )
        if not isinstance(seed, int) or isinstance(seed, bool):
            raise PatchUsageError(f"@pytest.mark.model on {where}: seed must be an int, got {seed!r}.")
        try:
            init = validate_init(options.pop("init", DEFAULT_INIT))
            validate_fusion_config(fusion)
            for axis, name in chosen.items():
                validate_implementation(axis, name)
            request = cls(args[0], options, seed, fusion, init, **chosen, transforms=transforms)
            spec = request.model_spec  # refuses an override that is no config field; kept for the loads
        except PatchUsageError as exc:
            raise PatchUsageError(f"@pytest.mark.model on {where}: {exc}") from None
        weighted = {name for name in ("seed", "init") if name in kwargs}
        if spec.source_dir is not None and not options and weighted:
            raise PatchUsageError(
                f"@pytest.mark.model on {where}: {' and '.join(sorted(weighted))} shape the seeded tiny checkpoints, "
                f"but {spec.source_dir} has its own weights. Drop {', '.join(sorted(weighted))}, or pass a model type."
            )
        return request

    @functools.cached_property
    def model_spec(self) -> ModelSpec:
        """The spec resolved to the config both models are built from, once: a tiny config is not cached."""
        return resolve_model_spec(self.spec, **dict(self.overrides))

    def load_kwargs(self) -> dict[str, Any]:
        """``from_pretrained`` keywords both models are loaded with."""
        return {axis: getattr(self, axis) for axis in IMPLEMENTATIONS if getattr(self, axis)}

    def transformed(self, model: Any) -> Any:
        """``model`` through :attr:`transforms`, from generators seeded with :attr:`seed` (the caller's put back)."""
        if not self.transforms:
            return model
        with seeded_generators(first_parameter_device(model), self.seed):
            return apply_transforms(model, self.transforms)


@dataclass(frozen=True)
class LoadChoices:
    """How the patch marks load the patched model: ``from_pretrained`` keywords, then transforms.

    ``reference_kwargs`` is what the reference loads with instead: for each implementation
    axis the patch sets, the model marker's choice, else transformers' ground truth
    (``"eager"``), so a custom attention or experts function is compared with the original
    computation rather than with itself.
    """

    kwargs: Mapping[str, Any] = field(default_factory=dict)
    transforms: tuple[Any, ...] = ()

    def reference_kwargs(self, request: ModelRequest) -> dict[str, Any]:
        shared = request.load_kwargs()
        return {**shared, **{axis: shared.get(axis, GROUND_TRUTH) for axis in IMPLEMENTATIONS if axis in self.kwargs}}

    def patched_kwargs(self, request: ModelRequest) -> dict[str, Any]:
        return {**request.load_kwargs(), **self.kwargs}

    def check(self) -> None:
        """Refuse implementation names transformers does not know, as it would, with did-you-mean."""
        for axis in IMPLEMENTATIONS:
            validate_implementation(axis, self.kwargs.get(axis))

    def transform(self, model: Any) -> Any:
        """Apply the transforms in order: each returns the model to go on with, or None (changed in place)."""
        return apply_transforms(model, self.transforms)


def apply_transforms(model: Any, transforms: Sequence[Callable[[Any], Any]]) -> Any:
    """``model`` through each of ``transforms`` in order: each returns the model to go on with, or None (changed in place)."""
    for fn in transforms:
        result = fn(model)
        model = model if result is None else result
    return model


def validate_fusion_config(fusion: Any) -> None:
    """Refuse a ``fusion_config`` that is not a dict of transformers' fusion names."""
    if fusion is None:
        return
    if not isinstance(fusion, Mapping):
        raise PatchUsageError("fusion_config must be a dict such as {'patch_embeddings': True}.")
    from transformers import fusion_mapping

    known = sorted(getattr(fusion_mapping, "_FUSION_REGISTRY", {}))  # private in transformers 5.23
    for name in fusion:
        if known and name not in known:
            raise PatchUsageError(
                f"fusion_config key {name!r} is not a transformers fusion{_did_you_mean(name, known)}"
            )


def validate_attn_implementation(value: Any) -> None:
    """Refuse an ``attn_implementation`` transformers does not know (a hub kernel ``org/name`` is left to it)."""
    if value is None:
        return
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    known = ["eager", *ALL_ATTENTION_FUNCTIONS.valid_keys()]
    if not isinstance(value, str) or ("/" not in value and value not in known):
        raise PatchUsageError(
            f"attn_implementation={value!r} is not an attention implementation{_did_you_mean(str(value), known)}"
        )


def validate_experts_implementation(value: Any) -> None:
    """Refuse an ``experts_implementation`` transformers' ``ExpertsInterface`` does not know."""
    if value is None:
        return
    try:
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
    except ImportError:  # transformers before the experts interface: from_pretrained says what it accepts
        return
    known = ["eager", *ALL_EXPERTS_FUNCTIONS.valid_keys()]
    if not isinstance(value, str) or value not in known:
        raise PatchUsageError(
            f"experts_implementation={value!r} is not an experts implementation{_did_you_mean(str(value), known)}"
        )


def validate_implementation(axis: str, name: Any) -> None:
    """Refuse a name transformers does not know for the implementation keyword ``axis`` (``None``: none chosen)."""
    checks = {
        "attn_implementation": validate_attn_implementation,
        "experts_implementation": validate_experts_implementation,
    }
    checks[axis](name)


def is_transformers_own(axis: str, name: str | None) -> bool:
    """``name`` is one of transformers' own implementations (not a function a user registered)."""
    if name is None or name == GROUND_TRUTH or "/" in name:
        return True
    if axis == "attn_implementation":
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS as functions
    else:
        try:
            from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS as functions
        except ImportError:
            return True
    function = functions.get(name)
    return function is None or getattr(function, "__module__", "").startswith("transformers")


def _did_you_mean(name: str, valid: list[str]) -> str:
    close = difflib.get_close_matches(name, valid, n=3, cutoff=0.5)
    hint = f" Did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
    return f".{hint} Valid: {', '.join(valid)}."


NOTHING_PATCHED = (
    "nothing patches this model: no class mapping or conversions are registered, no method or context patch is "
    "active, and no attn_implementation, experts_implementation, load_kwargs, transform, fusion_config or sharding "
    "is given. It would be the reference model compared with itself, and pass whatever the patch under test does. "
    "Give the patch: @pytest.mark.patch({'LlamaMLP': MyMLP}) (or methods=, context=, attn_implementation=, "
    "load_kwargs=, transform=), or patch_registry.register({...}) before the model is built. A patch made outside "
    "these (a fixture calling a kernel library's apply function) reaches the reference model too: pass it as "
    "@pytest.mark.patch(context=...). To compare the stock model with itself on purpose (a baseline), mark the "
    "test @pytest.mark.patch(unpatched=True), or call model_builder.patched(..., unpatched=True)."
)


def patch_sources(keys: Sequence[str], request: ModelRequest, choices: LoadChoices | None) -> list[str]:
    """What makes a patched load differ from the reference's: registered keys and conversions, method or context
    patches (a pristine scope is open), the patched load's choices (implementations, load keywords,
    transforms, sharding) and a fusion_config. Empty: the load would be the reference's."""
    found = ["mapping"] if keys else []
    conversions = getattr(sys.modules.get("transformers.conversion_mapping"), "USER_REGISTERED_MAPPINGS", None)
    found += ["conversions"] if conversions else []
    # a scope is open while the test's marks hold method or context patches (whatever they rebind, or where)
    found += ["method or context patches"] if current_scope() is not None else []
    found += ["load choices"] if choices is not None and (choices.kwargs or choices.transforms) else []
    found += ["fusion_config"] if request.fusion_config else []
    return found


class ModelBuilder:
    """Session-wide source of checkpoints and models; the ``model_builder`` fixture.

    Example::

        def test_many(model_builder, dtype):
            request = ModelRequest("llama", {"num_hidden_layers": 3})
            reference = model_builder.reference(request, dtype=dtype)
    """

    def __init__(self, cache_dir: Path, model_cache: CacheBound | None = None) -> None:
        self.cache_dir = Path(cache_dir)
        # reference models by (checkpoint, dtype, device, attention); least recently used released past the bound
        self._references = ModelCache(model_cache)

    def checkpoint(self, request: ModelRequest, *, dtype: Any = "float32") -> Path:
        """The checkpoint directory: the given one, or a seeded tiny model saved once."""
        spec = request.model_spec
        if spec.source_dir is not None and not request.overrides:
            return spec.source_dir
        return cached_checkpoint(
            spec.config, dtype=dtype_name(dtype), seed=request.seed, cache_dir=self.cache_dir, init=request.init
        )

    def reference(
        self, request: ModelRequest, *, dtype: Any = "float32", device: str = "cpu", choices: LoadChoices | None = None
    ) -> torch.nn.Module:
        """The unpatched model, built once per (checkpoint, dtype, device) and shared: do not modify it.

        Kept in memory under ini ``modelpatch_model_cache`` (least recently used released first);
        a released one is loaded again from its checkpoint when asked for.

        Built and called outside the test's patches (see ``models/reference.py``); a cached one
        that is no longer pristine, or no longer what was built (a hook left on it, a weight
        edited, a mode flipped), is rebuilt.
        """
        path = self.checkpoint(request, dtype=dtype)
        load = choices.reference_kwargs(request) if choices is not None else request.load_kwargs()
        # the transforms themselves (compared by identity) and the seed they run from
        transforms = (request.transforms, request.seed) if request.transforms else ()
        key = (str(path), dtype_name(dtype), str(device), repr(sorted(load.items())), transforms)
        cached = self._references.get(key)
        if cached is not None and not reference_problems(cached) and not reference_changes(cached):
            return cached
        with pristine():
            # transformed in the pristine world too, and recorded after: its adapters are the reference's own
            model = prepare_reference(request.transformed(load_pretrained(path, dtype=dtype, device=device, **load)))
        self._references.put(key, model)
        return model

    def take_back(self, model: torch.nn.Module) -> str | None:
        """A reference a test was handed, given back after it: what the test changed in it, ``None`` if nothing.

        ``.grad`` is cleared (a backward on the reference changes nothing it computes). A changed
        model leaves the cache, so the next test gets a freshly built one; so does one whose own
        forward re-derived a buffer (dynamic RoPE), with nothing to say.
        """
        clear_gradients(model)
        changes = reference_changes(model)
        if changes:
            self._references.discard(model)
        return str(changes) if changes.changes else None

    def patched(
        self,
        request: ModelRequest,
        *,
        dtype: Any = "float32",
        device: str = "cpu",
        choices: LoadChoices | None = None,
        may_match_nothing: Iterable[str] = (),
        unpatched: bool = False,
    ) -> torch.nn.Module:
        """The model loaded with whatever patches and conversions are registered now, and the test's load choices.

        ``choices`` (the patch marks' ``attn_implementation``, ``experts_implementation``,
        ``load_kwargs`` and ``transform``) reach this load only; transforms run last, in order.
        A registered key that replaces no class of the model is an error (a typo, a stale name),
        except those in ``may_match_nothing``: keys whose ``NO_MATCH`` the test allows, and a
        sweep's keys aimed at other families. With nothing to patch it is a usage error, since it
        would be the reference compared with itself; ``unpatched=True`` asks for the stock model on
        purpose (a baseline).
        """
        from transformers import monkey_patching

        if choices is not None:
            choices.check()
        every_key = list(monkey_patching.get_patch_mapping())
        if not unpatched and not patch_sources(every_key, request, choices):
            raise PatchUsageError(NOTHING_PATCHED)
        path = self.checkpoint(request, dtype=dtype)
        optional = set(may_match_nothing)
        keys = [key for key in every_key if key not in optional]
        extra: dict[str, Any] = {"fusion_config": dict(request.fusion_config)} if request.fusion_config else {}
        extra.update(choices.patched_kwargs(request) if choices is not None else request.load_kwargs())
        model = load_pretrained(path, dtype=dtype, device=device, **extra)
        scope = current_scope()
        if scope is not None:
            scope.settle()  # a loader wrapper may have patched while loading
        if keys:
            require_keys_applied(keys, self.reference(request, dtype=dtype, device=device, choices=choices), model)
        track_patch_usage(model, set(monkey_patching.get_patch_mapping().values()))
        model = request.transformed(model)  # the model marker's, as the reference got them
        if choices is not None and choices.transforms:
            model = choices.transform(model)
        if scope is not None and (request.transforms or (choices is not None and choices.transforms)):
            scope.settle()  # an instance patcher may rebind class or module attributes
        return model

    def patched_structure(self, request: ModelRequest, *, dtype: Any = "float32") -> torch.nn.Module:
        """The patched model's modules on the meta device: what a load with the patches registered now builds.

        No weights are read or allocated (milliseconds): enough to check a plan against its names
        before a sharded load. ``from_config`` applies the registered patch mapping, as loading does.
        """
        from transformers import AutoConfig

        path = self.checkpoint(request, dtype=dtype)
        cls = checkpoint_model_class(path)
        config = AutoConfig.from_pretrained(path)
        with torch.device("meta"):
            return cls._from_config(config)


def module_class_names(model: torch.nn.Module) -> set[str]:
    """The class names of every module in ``model``."""
    return {type(module).__name__ for module in model.modules()}


def keys_used(keys: list[str], class_names: set[str]) -> set[str]:
    """Which keys replace at least one of ``class_names``, by transformers' rules (exact names first)."""
    used = set()
    for name in class_names:
        if name in keys:
            used.add(name)
            continue
        for key in keys:
            try:
                if key != name and re.search(key, name):
                    used.add(key)
                    break
            except re.error:
                continue
    return used


def require_keys_applied(keys: list[str], reference: torch.nn.Module, patched: torch.nn.Module) -> None:
    """Fail when a registered key matches no module class of this model (a typo or a stale name).

    The model's own class does not count: ``from_pretrained`` has chosen it before it enters
    transformers' ``apply_patches`` (5.x ``modeling_utils``), which replaces the classes a model
    builds, never the one it is. A key for ``LlamaForCausalLM`` leaves the patched model the stock
    one, which compared with the reference would pass whatever the replacement computes.
    """
    root = type(reference).__name__
    names = module_class_names(reference) - {root}
    unused = [key for key in keys if key not in keys_used(keys, names)]
    if not unused:
        return
    lines = []
    for key in unused:
        if keys_used([key], {root}):
            lines.append(
                f"  patch key {key!r} replaces {root}, the model's own class, which from_pretrained chooses before "
                "it applies the patch mapping: the patched model would be the stock one. Patch its methods with "
                f"@pytest.mark.patch(methods=[...]) (_PATCHED_CLASS_ = {root}) or context=..., or key a class the "
                "model builds."
            )
            continue
        close = difflib.get_close_matches(key, sorted(names), n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        lines.append(f"  patch key {key!r} replaced nothing: no module class of this model matches it.{hint}")
    raise PatchNotAppliedError(
        f"{type(patched).__name__} ({getattr(patched.config, 'model_type', '?')}) was loaded with patches that "
        "did not apply:\n" + "\n".join(lines) + f"\nModule classes in this model: {', '.join(sorted(names))}."
    )
