"""How each kind of ``@pytest.mark.parallel`` shards the patched model in a rank (the reference stays whole).

- ``"tp"``: transformers' own tensor parallelism at load, ``distributed_config=DistributedConfig(tp_plan=...)``
  (``tp_plan=`` on releases without it), with the patch marks' ``tp_plan`` entries merged in;
- ``"fsdp"``: torch's ``fully_shard`` on each decoder layer, then on the model, as accelerate and trl do
  (``layout="root"``); with ``layout="per_module"`` on the input embeddings and ``lm_head`` as well, as
  torchtitan does;
- ``"ddp"``: ``DistributedDataParallel`` around the model;
- ``mesh={"fsdp": 2, "tp": 2}``: both at load, by transformers' ``DistributedConfig(tp_size=, fsdp_size=)``,
  which builds the 2-D mesh and applies FSDP2 with the model's own FSDP plan over tensor parallelism.

Before a TP load the plan is checked against the patched model's own structure (built on the
meta device with the test's patches): an entry that names nothing, or a plan entry of transformers'
that named a module the patch replaced, is a usage error here. transformers itself only logs the
second, on rank 0, and then runs that module unsharded (or fails on a shape much later).
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from pytest_modelpatch.errors import PatchUsageError

# a plan entry the patch marks remove: transformers' style that shards nothing and hooks nothing
REPLICATE = "replicate"


def wildcard_names(model: torch.nn.Module) -> set[str]:
    """Every module and parameter name with layer numbers as ``*``, as transformers matches plan keys."""
    names = [n for n, _ in model.named_modules()] + [n for n, _ in model.named_parameters()]
    return {re.sub(r"\.\d+(\.|$)", lambda m: ".*" + m.group(1), n) for n in names if n}


@dataclass
class TensorParallelPlan:
    """The patched model's plan: transformers' (from its config and classes) with the marks' entries merged."""

    override: dict[str, str] = field(default_factory=dict)  # what DistributedConfig(tp_plan=...) is given
    effective: dict[str, str] = field(default_factory=dict)

    @property
    def empty(self) -> bool:
        return not any(style != REPLICATE for style in self.effective.values())


def resolve_tp_plan(
    entries: Mapping[str, str | None], patched_structure: torch.nn.Module, reference: torch.nn.Module
) -> TensorParallelPlan:
    """Merge the marks' ``tp_plan`` entries into the patched model's plan; refuse entries that shard nothing.

    ``entries`` are written as in ``config.base_model_tp_plan`` (``"layers.*.self_attn.qkv_proj"``) or
    from the top model (``"lm_head"``, ``"model.layers.*.mlp"``); ``None`` removes an entry.
    ``patched_structure`` is the patched model on the meta device, ``reference`` the whole reference.
    """
    names = wildcard_names(patched_structure)
    base = dict(getattr(patched_structure, "tp_plan", None) or {})
    prefix = _base_prefix(patched_structure)
    plan = TensorParallelPlan()
    problems = []
    for key, style in entries.items():
        top = key if key in names or key in base or not prefix else f"{prefix}.{key}"
        if top not in names and top not in base:
            close = difflib.get_close_matches(top, sorted(names), n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            problems.append(f"tp_plan entry {key!r} names no module or parameter of the patched model.{hint}")
            continue
        plan.override[top] = REPLICATE if style is None else str(style)
    plan.effective = {**base, **plan.override}
    reference_names = wildcard_names(reference)
    for key, style in plan.effective.items():
        if style != REPLICATE and key not in names and key in reference_names:
            problems.append(
                f"tp_plan entry {key!r} ({style}, transformers' plan for this model) shards a module the patch replaced: "
                "the patched model has no such module, so it would run unsharded (transformers only logs this, on "
                f"rank 0). Plan the modules that replaced it, and remove this entry: tp_plan={{{key!r}: None, ...}}."
            )
    if problems:
        raise PatchUsageError("the tensor-parallel plan does not fit the patched model:\n  " + "\n  ".join(problems))
    return plan


def _base_prefix(model: torch.nn.Module) -> str:
    """``"model"`` when the top model holds its base model there (LlamaForCausalLM), else ``""``."""
    prefix = getattr(model, "base_model_prefix", "")
    return prefix if prefix and getattr(model, "base_model", model) is not model else ""


def validate_tp_heads(config: Any, world_size: int, model: str, sharded: str = "") -> None:
    """Refuse a world size that does not divide the attention heads or the key/value heads: a usage error.

    ``world_size`` is the tensor-parallel size (the mesh's ``tp``); ``sharded`` the marker as written, when
    not ``parallel('tp', world_size=N)``.

    transformers' colwise plan gives each rank ``heads / world_size`` heads; otherwise the shapes
    fail deep inside its attention, on every rank.
    """
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = getattr(text, "num_attention_heads", None)
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    named = ((heads, "num_attention_heads"), (kv_heads, "num_key_value_heads"))
    if not any(isinstance(n, int) and n % world_size for n, _ in named):
        return
    divisors = [d for d in range(2, (heads or 2) + 1) if all(isinstance(n, int) and not n % d for n, _ in named)]
    have = " and ".join(f"{n} ({what})" for n, what in named)
    size = "a 'tp' size" if sharded else "a world size"
    sharded = sharded or f"parallel('tp', world_size={world_size})"
    raise PatchUsageError(
        f"{sharded} cannot shard {model}: tensor parallelism gives each rank an equal share of the attention heads, "
        f"and its heads, {have}, do not divide by {world_size}. Use {size} that divides both "
        f"({', '.join(map(str, divisors)) or 'none above 1'}), or give the model heads that divide: "
        "@pytest.mark.model(..., num_attention_heads=..., num_key_value_heads=...)."
    )


def tp_load_kwargs(plan: TensorParallelPlan) -> dict[str, Any]:
    """The ``from_pretrained`` keywords that shard the model with ``plan`` across the process group."""
    override: Any = plan.override or "auto"
    try:
        from transformers.distributed import DistributedConfig
    except ImportError:  # transformers before DistributedConfig took the plan: tp_plan= on from_pretrained
        return {"tp_plan": override}
    return {"distributed_config": DistributedConfig(tp_plan=override)}


def mesh_load_kwargs(plan: TensorParallelPlan, mesh: tuple[tuple[str, int], ...]) -> dict[str, Any] | None:
    """The ``from_pretrained`` keywords that shard the model on ``mesh`` (tensor parallel on ``tp``, FSDP2 on the rest).

    transformers (5.21 on) builds the mesh itself from the sizes (``init_device_mesh`` with the dimension
    names ``pp, dp_replicate, fsdp, tp``) and ignores a ``device_mesh=`` given beside a ``DistributedConfig``:
    the sizes are how it takes a mesh. ``None`` on a release whose ``DistributedConfig`` has no ``fsdp_size``.
    """
    try:
        from transformers.distributed import DistributedConfig
    except ImportError:
        return None
    if "fsdp_size" not in getattr(DistributedConfig, "__dataclass_fields__", {}):
        return None
    sizes = {f"{name}_size": size for name, size in mesh}
    return {"distributed_config": DistributedConfig(tp_plan=plan.override or "auto", **sizes)}


def decoder_layer_paths(reference: torch.nn.Module) -> list[str]:
    """Where the reference's decoder layers are (its ``_no_split_modules`` classes), outermost first.

    The patched model is sharded at the same places, whatever class a patch put there.
    """
    classes = set(getattr(reference, "_no_split_modules", None) or [])
    found: list[str] = []
    for name, module in reference.named_modules():
        if name and type(module).__name__ in classes and not any(name.startswith(f"{outer}.") for outer in found):
            found.append(name)
    return found


def fully_shard_layers(
    layer_paths: list[str], per_module: bool = False
) -> Callable[[torch.nn.Module], torch.nn.Module]:
    """A transform: ``fully_shard`` each module at ``layer_paths``, then the model (FSDP2, as accelerate applies it).

    ``per_module``: the input embeddings and the output embeddings (``lm_head``) are units of their own
    first, as torchtitan's ``parallelize_llama`` shards them; tied, they are one unit, as transformers'
    FSDP plan folds them. Their weights are then ``DTensor`` shards outside their own modules' forwards.
    """

    def shard(model: torch.nn.Module) -> torch.nn.Module:
        from torch.distributed.fsdp import fully_shard

        modules = dict(model.named_modules())
        for path in layer_paths:
            if path in modules:
                fully_shard(modules[path])
        if per_module:
            for unit in embedding_units(model):
                fully_shard(unit if len(unit) > 1 else unit[0])
        fully_shard(model)
        return model

    shard.__name__ = "fully_shard"
    return shard


def embedding_units(model: torch.nn.Module) -> list[list[torch.nn.Module]]:
    """The input and output embeddings as FSDP units: one each, or one together when they share their weight."""
    found = [getter() for getter in (getattr(model, "get_input_embeddings", None),
                                     getattr(model, "get_output_embeddings", None)) if getter is not None]  # fmt: skip
    found = [m for m in found if isinstance(m, torch.nn.Module) and any(True for _ in m.parameters())]
    if len(found) == 2 and found[0] is not found[1]:
        tied = {id(p) for p in found[0].parameters()} & {id(p) for p in found[1].parameters()}
        return [found] if tied else [[found[0]], [found[1]]]
    return [found[:1]] if found else []


def tensor_parallel_group(model: torch.nn.Module) -> Any:
    """The process group of this rank's tensor-parallel dimension, from a parameter on a named mesh; else ``None``."""
    for param in model.parameters():
        mesh = getattr(param, "device_mesh", None)
        if mesh is not None and "tp" in (getattr(mesh, "mesh_dim_names", None) or ()):
            return mesh["tp"].get_group() if mesh.ndim > 1 else mesh.get_group()
    return None


def data_parallel(model: torch.nn.Module) -> torch.nn.Module:
    """A transform: the model inside ``DistributedDataParallel`` (on its own GPU under nccl)."""
    device = next(model.parameters()).device
    ids = [device.index] if device.type == "cuda" else None
    return torch.nn.parallel.DistributedDataParallel(model, device_ids=ids)
