"""``@pytest.mark.parallel(kind, world_size=2, timeout=300, layout=..., mesh=...)`` read into a :class:`ParallelSpec`.

Torch-free: the controller reads it at collection and before starting ranks.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pytest_modelpatch.errors import PatchUsageError

KINDS = {
    "tp": "tensor parallelism, through transformers' own plan (distributed_config=DistributedConfig(tp_plan=...))",
    "fsdp": "FSDP2: torch's fully_shard on each decoder layer, then on the model, as accelerate and trl apply it",
    "ddp": "DistributedDataParallel around the model",
    None: "nothing sharded: the ranks run the test, which shards by itself",
}
MESH = "mesh"  # the kind of a test marked with mesh=: tensor parallelism and FSDP2 (and HSDP) at once
# the dimensions of mesh=, outermost first, named as transformers' DistributedConfig names its mesh's
MESH_DIMS = ("dp_replicate", "fsdp", "tp")
LAYOUTS = {
    "root": "each decoder layer its own unit; the embeddings, final norm and lm_head in the root unit (accelerate's "
    "transformer-layer wrap policy)",
    "per_module": "the input embeddings and lm_head each their own unit too (tied, one unit together), as torchtitan "
    "and transformers' own FSDP plan shard them",
}
DEFAULT_WORLD_SIZE = 2
DEFAULT_TIMEOUT = 300.0
PARALLEL_MARKER_HELP = (
    "parallel(kind=None, *, world_size=2, timeout=300, layout='root', mesh=None): run the test in world_size "
    "processes joined by torch.distributed (gloo on CPU, nccl on CUDA), the patched model sharded by kind ('tp', "
    "'fsdp' with its layout 'root' or 'per_module', 'ddp' or None) or on a 2-D mesh such as mesh={'fsdp': 2, "
    "'tp': 2} (FSDP2 over tensor parallelism, world size the product), the reference whole on every rank; a rank "
    "that fails, crashes, skips alone or hangs past timeout seconds fails the test"
)


@dataclass(frozen=True)
class ParallelSpec:
    """How a test runs on ``torch.distributed``: the sharding kind, the number of ranks, the time it may take."""

    kind: str | None = None
    world_size: int = DEFAULT_WORLD_SIZE
    timeout: float = DEFAULT_TIMEOUT
    layout: str = "root"
    mesh: tuple[tuple[str, int], ...] = ()  # (dimension, size), outermost first, when kind is MESH

    def __str__(self) -> str:
        if self.kind == MESH:
            return f"parallel(mesh={dict(self.mesh)})"
        layout = f", layout={self.layout!r}" if self.layout != "root" else ""
        return f"parallel({self.kind!r}, world_size={self.world_size}{layout})"

    @property
    def tp_size(self) -> int:
        """The ranks a tensor-parallel layer is split over (the whole world under ``"tp"``, 1 without TP)."""
        if self.kind == MESH:
            return dict(self.mesh).get("tp", 1)
        return self.world_size if self.kind == "tp" else 1

    @classmethod
    def from_marker(cls, args: tuple[Any, ...], kwargs: Mapping[str, Any], where: str) -> ParallelSpec:
        """Validate the mark's arguments; a wrong one is a usage error naming the fix."""
        options = dict(kwargs)
        if len(args) > 1 or (args and "kind" in options):
            raise PatchUsageError(
                f"@pytest.mark.parallel on {where} takes one positional argument, the kind ('tp', 'fsdp', 'ddp' or "
                "None), e.g. @pytest.mark.parallel('tp', world_size=2)."
            )
        kind = args[0] if args else options.pop("kind", None)
        world_size = options.pop("world_size", DEFAULT_WORLD_SIZE)
        timeout = options.pop("timeout", DEFAULT_TIMEOUT)
        layout = options.pop("layout", "root")
        mesh = options.pop("mesh", None)
        if options:
            raise PatchUsageError(
                f"@pytest.mark.parallel on {where} got unknown keyword(s) {sorted(options)}; it takes kind, world_size, "
                "timeout, layout and mesh."
            )
        if mesh is not None:
            dims = _mesh_dims(mesh, where)
            size = math.prod(n for _, n in dims)
            if args or "kind" in kwargs:
                raise PatchUsageError(
                    f"@pytest.mark.parallel on {where}: give either a kind or mesh=, not both: mesh={mesh!r} names "
                    f"every dimension. Write @pytest.mark.parallel(mesh={mesh!r})."
                )
            if "world_size" in kwargs and world_size != size:
                raise PatchUsageError(
                    f"@pytest.mark.parallel on {where}: world_size={world_size!r} but mesh={mesh!r} needs {size} ranks "
                    "(the product of its sizes); leave world_size out."
                )
            if "layout" in kwargs:
                raise PatchUsageError(
                    f"@pytest.mark.parallel on {where}: layout= is for parallel('fsdp'); under mesh= transformers "
                    "applies FSDP2 by the model's own FSDP plan (its fsdp_plan). Remove layout=."
                )
            _check_timeout(timeout, where)
            return cls(MESH, size, float(timeout), mesh=dims)
        if kind not in KINDS:
            known = ", ".join(repr(k) for k in KINDS)
            raise PatchUsageError(f"@pytest.mark.parallel on {where}: unknown kind {kind!r}; use one of {known}.")
        if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 2:
            raise PatchUsageError(
                f"@pytest.mark.parallel on {where}: world_size must be an int of at least 2 (the ranks to run), "
                f"got {world_size!r}."
            )
        if layout not in LAYOUTS or (layout != "root" and kind != "fsdp"):
            raise PatchUsageError(
                f"@pytest.mark.parallel on {where}: layout={layout!r} is not an FSDP layout of parallel({kind!r}); "
                f"layout= takes {' or '.join(map(repr, LAYOUTS))}, with kind 'fsdp', e.g. "
                "@pytest.mark.parallel('fsdp', layout='per_module')."
            )
        _check_timeout(timeout, where)
        return cls(kind, world_size, float(timeout), layout)


def _check_timeout(timeout: Any, where: str) -> None:
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise PatchUsageError(
            f"@pytest.mark.parallel on {where}: timeout must be a positive number of seconds, got {timeout!r}."
        )


def _mesh_dims(mesh: Any, where: str) -> tuple[tuple[str, int], ...]:
    """``mesh=`` as (dimension, size) pairs in :data:`MESH_DIMS` order; a wrong one is a usage error naming the fix."""
    example = "e.g. mesh={'fsdp': 2, 'tp': 2}"
    if not isinstance(mesh, dict) or not mesh:
        raise PatchUsageError(
            f"@pytest.mark.parallel on {where}: mesh must be a dict of dimension name to size, {example}; got {mesh!r}."
        )
    unknown = sorted(str(name) for name in mesh if name not in MESH_DIMS)
    if unknown:
        raise PatchUsageError(
            f"@pytest.mark.parallel on {where}: mesh dimension(s) {unknown} unknown; use {', '.join(MESH_DIMS)} "
            f"(transformers' DistributedConfig names), {example}."
        )
    for name, size in mesh.items():
        if not isinstance(size, int) or isinstance(size, bool) or size < 2:
            raise PatchUsageError(
                f"@pytest.mark.parallel on {where}: mesh[{name!r}] must be an int of at least 2, got {size!r}; "
                "leave out a dimension of size 1."
            )
    if "tp" not in mesh or len(mesh) < 2:
        raise PatchUsageError(
            f"@pytest.mark.parallel on {where}: mesh={mesh!r} is not two-dimensional: it shards by tensor parallelism "
            f"('tp') and at least one data-parallel dimension ('fsdp', 'dp_replicate'), {example}. For one dimension "
            "use the kind: @pytest.mark.parallel('tp') or ('fsdp')."
        )
    if "dp_replicate" in mesh and "fsdp" not in mesh:
        raise PatchUsageError(
            f"@pytest.mark.parallel on {where}: mesh={mesh!r}: dp_replicate (HSDP) replicates FSDP2's shards, so it "
            "needs an 'fsdp' dimension too, e.g. mesh={'dp_replicate': 2, 'fsdp': 2, 'tp': 2}."
        )
    return tuple((name, mesh[name]) for name in MESH_DIMS if name in mesh)
