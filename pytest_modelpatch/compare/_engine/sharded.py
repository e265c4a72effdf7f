"""A sharded patched model's tensors made whole before they are compared with the unsharded reference's.

Under ``@pytest.mark.parallel`` the patched model is sharded across the ranks and the reference
is whole on every rank. What the patched side hands a comparison is then either a ``DTensor``
(parameters and gradients under tensor parallelism and FSDP2: gathered with ``full_tensor()``)
or, under tensor parallelism, a rank's plain slice of an activation or a cache tensor: a
colwise layer's output holds this rank's features, a KV cache this rank's heads. Those are
all-gathered along the one dimension where they differ from the reference's tensor, in rank
order. Every rank gathers the same tensors in the same order (the shapes are agreed first in one
collective), so a comparison stays a collective every rank takes part in: a check on a sharded
model runs on every rank, as the parallel tests run it.

Slices are gathered only within :func:`gathering_shards` (the ``patched_model`` fixture of a
``parallel("tp")`` test enters it for the test); ``DTensor`` leaves are made whole always.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any, TypeGuard

import torch

if TYPE_CHECKING:
    # for the type checker only: _is_dtensor tells a DTensor by its class name, importing nothing
    from torch.distributed.tensor import DTensor

_NOT_GATHERING = object()
# the process group whose ranks hold slices of one tensor (None: the whole world), or _NOT_GATHERING
_GATHER_SLICES: ContextVar[Any] = ContextVar("modelpatch_gather_slices", default=_NOT_GATHERING)


@contextmanager
def gathering_shards(group: Any = None) -> Iterator[None]:
    """Within the block, a patched tensor that is one rank's slice of the reference's is gathered whole first.

    ``group``: the ranks that split a tensor among them, the tensor-parallel dimension of a 2-D mesh
    (``mesh["tp"].get_group()``); ``None`` for every rank.
    Example (in every rank): ``with gathering_shards(): assert_equivalent(reference, tp_model)``.
    """
    token = _GATHER_SLICES.set(group)
    try:
        yield
    finally:
        _GATHER_SLICES.reset(token)


def _distributed() -> Any:
    if not torch.distributed.is_available() or not torch.distributed.is_initialized():
        return None
    return torch.distributed


def _is_dtensor(value: Any) -> TypeGuard[DTensor]:
    return type(value).__name__ == "DTensor" and hasattr(value, "full_tensor")


def whole(reference: Mapping[str, Any], patched: Mapping[str, Any]) -> Mapping[str, Any]:
    """``patched`` with every ``DTensor`` gathered and, when gathering, every rank's slice all-gathered.

    Returns ``patched`` itself when there is nothing to gather (outside a process group, no DTensor).
    """
    dist = _distributed()
    if dist is None:
        return patched
    group = _GATHER_SLICES.get()
    slices = group is not _NOT_GATHERING and dist.get_world_size(group) > 1
    if not slices and not any(_is_dtensor(v) for v in patched.values()):
        return patched
    local = {p: tuple(v.shape) for p, v in patched.items() if isinstance(v, torch.Tensor) and not _is_dtensor(v)}
    every: list[Any] = [None] * (dist.get_world_size(group) if slices else 1)
    if slices:
        dist.all_gather_object(every, local, group=group)  # one collective: the group then decides the same gathers
    out = dict(patched)
    for path, value in patched.items():
        if _is_dtensor(value):
            out[path] = value.full_tensor()
            continue
        ref = reference.get(path)
        if not slices or not isinstance(value, torch.Tensor) or not isinstance(ref, torch.Tensor):
            continue
        dim = _split_dim(tuple(ref.shape), [shapes.get(path) for shapes in every])
        if dim is not None:
            out[path] = _all_gather(value, dim, [shapes[path][dim] for shapes in every], dist, group)
    return out


def _split_dim(full: tuple[int, ...], shapes: list[tuple[int, ...] | None]) -> int | None:
    """The one dimension along which the ranks' shapes split ``full`` (sizes summing to it), else ``None``."""
    known = [s for s in shapes if s is not None]
    if len(known) != len(shapes) or any(len(s) != len(full) for s in known) or all(s == full for s in known):
        return None
    differing = {d for s in known for d, (a, b) in enumerate(zip(s, full)) if a != b}
    if len(differing) != 1:
        return None
    (dim,) = differing
    if any(s[:dim] + s[dim + 1 :] != full[:dim] + full[dim + 1 :] for s in known):
        return None
    return dim if sum(s[dim] for s in known) == full[dim] else None


def _all_gather(value: torch.Tensor, dim: int, sizes: list[int], dist: Any, group: Any = None) -> torch.Tensor:
    """Every rank's slice along ``dim``, concatenated in rank order (slices may differ in size: padded to send)."""
    largest = max(sizes)
    padded = value.detach().contiguous()
    if padded.shape[dim] < largest:
        pad = list(padded.shape)
        pad[dim] = largest - padded.shape[dim]
        padded = torch.cat([padded, padded.new_zeros(pad)], dim=dim)
    pieces = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(pieces, padded, group=group)
    return torch.cat([piece.narrow(dim, 0, size) for piece, size in zip(pieces, sizes)], dim=dim)


def sharding_line(model: torch.nn.Module) -> str:
    """``"sharded: tensor parallel over 2 ranks (gloo), seen on rank 0"`` for a sharded model, else ``""``.

    What a failure says about where it was seen; the rank is this process's.
    """
    dist = _distributed()
    if dist is None or dist.get_world_size() < 2:
        return ""
    kind = sharding_kind(model)
    if kind is None:
        return ""
    over = f"{dist.get_world_size()} ranks{_mesh_text(model)}"
    return f"sharded: {kind} over {over} ({dist.get_backend()}), seen on rank {dist.get_rank()}"


def _mesh_text(model: torch.nn.Module) -> str:
    """``", mesh fsdp=2 x tp=2"`` when the model's parameters lie on a mesh of several named dimensions, else ``""``."""
    for param in model.parameters():
        mesh = getattr(param, "device_mesh", None)
        if _is_dtensor(param) and mesh is not None and mesh.ndim > 1 and mesh.mesh_dim_names:
            dims = " x ".join(f"{n}={s}" for n, s in zip(mesh.mesh_dim_names, mesh.shape))
            return f", mesh {dims}"
    return ""


def mesh_fusion_hint(model: torch.nn.Module) -> str:
    """Why a model on a 2-D mesh may compute with misordered weights: a conversion-fused tensor split on both dimensions.

    transformers (5.24) loads a tensor that a weight conversion fuses from several checkpoint
    tensors (``qkv_proj`` from ``q/k/v_proj``) by slicing each source with the parameter's
    ``(fsdp, tp)`` placements and concatenating the slices. After FSDP2's all-gather a
    tensor-parallel rank then holds ``[q_0 | k_0 | v_0 | q_1 | k_1 | v_1]`` (one block per fsdp
    shard), not ``[q | k | v]`` of its own: the model is wrong, not the check. ``""`` when no such tensor.
    """
    fused = []
    for name, param in model.named_parameters():
        mesh = getattr(param, "device_mesh", None)
        placements: Sequence[Any] = getattr(param, "placements", ())
        dims = [p.dim % param.dim() for p in placements if hasattr(p, "dim")]
        if not _is_dtensor(param) or mesh is None or mesh.ndim < 2 or len(dims) < 2 or len(set(dims)) != 1:
            continue
        if _fused_source_sizes(model, name, tuple(param.shape), dims[0]) is not None:
            fused.append(name)
    if not fused:
        return ""
    more = f" (and {len(fused) - 1} more like it)" if len(fused) > 1 else ""
    return (
        f"hint: {fused[0]}{more} is fused by a weight conversion from several checkpoint tensors and split on both "
        "mesh dimensions. transformers loads it by slicing each source tensor with the parameter's (fsdp, tp) "
        "placements and concatenating the slices, so after FSDP2's all-gather each tensor-parallel rank holds its "
        "sources' slices interleaved by fsdp shard, not in order: the patched model computes with misordered "
        "weights. The patch itself may be right: run the same check under parallel('tp'), where the slices load in order."
    )


def _fsdp_module_class() -> Any:
    """FSDP2's module class; ``None`` on torch releases without it (before 2.6), where no model is FSDP2."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return None
    return FSDPModule


def sharding_kind(model: torch.nn.Module) -> str | None:
    """How ``model`` is sharded: ``"DistributedDataParallel"``, ``"FSDP2"``, ``"tensor parallel"``, or ``None``."""
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        return "DistributedDataParallel"
    fsdp_module = _fsdp_module_class()
    if fsdp_module is not None and any(isinstance(m, fsdp_module) for m in model.modules()):
        return "FSDP2 over tensor parallel" if _tensor_parallel(model) else "FSDP2"
    if any(_is_dtensor(p) for p in model.parameters()):
        return "tensor parallel"
    return None


def _tensor_parallel(model: torch.nn.Module) -> bool:
    """Whether a parameter is also split on a mesh dimension named ``tp`` (FSDP2 applied over tensor parallelism)."""
    for param in model.parameters():
        names = getattr(getattr(param, "device_mesh", None), "mesh_dim_names", None) or ()
        if _is_dtensor(param) and "tp" in names:
            return True
    return False


def resharded(model: torch.nn.Module) -> None:
    """Every FSDP2 unit of ``model`` resharded: its parameters are again the sharded ``DTensor``s its optimizer steps.

    A forward outside autograd leaves FSDP2's root unit unsharded (it expects a backward next): its
    module attributes are then plain tensors in an all-gather buffer that the next backward frees,
    and a copy that an optimizer step on the sharded parameters does not update. Whatever saves,
    restores or steps the parameters reshards first.
    """
    if _distributed() is None:
        return
    fsdp_module = _fsdp_module_class()
    if fsdp_module is None:
        return
    for module in model.modules():
        if isinstance(module, fsdp_module):
            module.reshard()


def local_part(tensor: torch.Tensor) -> torch.Tensor:
    """The part of ``tensor`` this rank holds (a ``DTensor``'s local shard), sharing its storage."""
    return tensor.to_local() if _is_dtensor(tensor) else tensor


def nonzero_anywhere(tensors: list[torch.Tensor]) -> list[bool]:
    """Whether each tensor has a nonzero element on any rank: one collective for all (none outside a process group).

    A rank's shard of a gradient may be all zero where another rank's is not (embedding rows no
    token of its batch used), so deciding from the local shard alone would make the ranks disagree.
    Every rank must call this with the same tensors, in the same order.
    """
    if not tensors:
        return []
    norms = torch._foreach_norm([local_part(t).detach() for t in tensors], float("inf"))
    largest = torch.stack([n.float().cpu() for n in norms])
    dist = _distributed()
    if dist is not None and any(_is_dtensor(t) for t in tensors):
        if dist.get_backend() == "nccl":
            largest = largest.to(torch.device("cuda", torch.cuda.current_device()))
        dist.all_reduce(largest, op=dist.ReduceOp.MAX)
    return [bool(v > 0) for v in largest.cpu()]


def ranks_disagree(tensors: Mapping[str, Any]) -> list[int]:
    """The ranks whose ``tensors`` (a check's inputs) differ from rank 0's; ``[]`` outside a process group.

    One collective of a few numbers per tensor: every rank must call it, with the same names.
    """
    dist = _distributed()
    if dist is None or dist.get_world_size() < 2:
        return []
    mine = []
    for name, value in tensors.items():
        if isinstance(value, torch.Tensor):
            flat = local_part(value).detach().reshape(-1).double().cpu()
            weights = torch.arange(1, flat.numel() + 1, dtype=torch.float64)
            mine.append((name, tuple(value.shape), float(flat.sum()), float((flat * weights).sum())))
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return [rank for rank, theirs in enumerate(every) if theirs != every[0]]


def logical_tensors(model: torch.nn.Module, tensors: Mapping[str, Any]) -> dict[str, Any]:
    """A sharded model's parameters or gradients made whole, each in the layout its checkpoint names describe.

    A ``DTensor`` is gathered with ``full_tensor()``, except one that a weight conversion filled from
    several checkpoint tensors (a fused ``qkv_proj`` from ``q/k/v_proj``): transformers shards each of
    those before fusing them, so a rank holds ``[q_r | k_r | v_r]`` while the placement says a plain
    ``Shard``, and ``full_tensor()`` would interleave the ranks' slices. Such a tensor is rebuilt as
    ``[q | k | v]``, which the conversion's reverse then splits as ``save_pretrained`` would.
    Every rank must call this with the same names, in the same order.
    """
    dist = _distributed()
    if dist is None or not any(_is_dtensor(v) for v in tensors.values()):
        return dict(tensors)
    out = {}
    for name, value in tensors.items():
        if not _is_dtensor(value):
            out[name] = value
            continue
        dim = _shard_dim(value)
        sizes = _fused_source_sizes(model, name, tuple(value.shape), dim) if dim is not None else None
        out[name] = (
            value.full_tensor() if sizes is None or dim is None else _unpack_fused(value.to_local(), dim, sizes, dist)
        )
    return out


def _shard_dim(value: Any) -> int | None:
    """The dimension a one-mesh-dimension ``Shard`` placement splits (not a strided one), else ``None``."""
    placements: Sequence[Any] = getattr(value, "placements", ())
    if len(placements) != 1 or type(placements[0]).__name__ != "Shard":
        return None
    return placements[0].dim % value.dim()


def _fused_source_sizes(model: torch.nn.Module, name: str, shape: tuple[int, ...], dim: int) -> list[int] | None:
    """The sizes along ``dim`` of the checkpoint tensors a conversion fused into ``name``, in order; ``None`` if not fused."""
    if not getattr(model, "_weight_conversions", None):
        return None
    from transformers.core_model_loading import revert_weight_conversion

    try:
        split = revert_weight_conversion(model, {name: torch.empty(shape, device="meta")})
    except Exception:  # noqa: BLE001 - a reverse op that cannot run on meta tensors: gathered as it is
        return None
    parts = [t[0] if isinstance(t, list) else t for t in split.values()]
    if len(parts) < 2 or not all(isinstance(p, torch.Tensor) and p.dim() == len(shape) for p in parts):
        return None
    rest = [shape[:dim] + shape[dim + 1 :] == tuple(p.shape[:dim] + p.shape[dim + 1 :]) for p in parts]
    sizes = [int(p.shape[dim]) for p in parts]
    return sizes if all(rest) and sum(sizes) == shape[dim] else None


def _chunk(size: int, rank: int, world: int) -> tuple[int, int]:
    """(offset, length) of rank ``rank``'s ``Shard`` slice of ``size`` elements (``torch.chunk``'s sizes)."""
    step = -(-size // world)
    start = min(rank * step, size)
    return start, min(step, size - start)


def _unpack_fused(local: torch.Tensor, dim: int, sizes: list[int], dist: Any) -> torch.Tensor:
    """The logical ``[s1 | s2 | ...]`` from every rank's ``[s1_r | s2_r | ...]``."""
    world = dist.get_world_size()
    held = [sum(_chunk(size, r, world)[1] for size in sizes) for r in range(world)]
    locals_ = _all_gather(local, dim, held, dist).split(held, dim=dim)
    sources = []
    for s, size in enumerate(sizes):
        pieces = []
        for r, block in enumerate(locals_):
            offset = sum(_chunk(sizes[i], r, world)[1] for i in range(s))
            pieces.append(block.narrow(dim, offset, _chunk(size, r, world)[1]))
        sources.append(torch.cat(pieces, dim=dim))
    return torch.cat(sources, dim=dim)
