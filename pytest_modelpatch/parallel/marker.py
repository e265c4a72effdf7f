"""``@pytest.mark.parallel(kind, world_size=2, timeout=300)`` read into a :class:`ParallelSpec`.

Torch-free: the controller reads it at collection and before starting ranks.
"""

from __future__ import annotations

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
DEFAULT_WORLD_SIZE = 2
DEFAULT_TIMEOUT = 300.0
PARALLEL_MARKER_HELP = (
    "parallel(kind=None, *, world_size=2, timeout=300): run the test in world_size processes joined by "
    "torch.distributed (gloo on CPU, nccl on CUDA), the patched model sharded by kind ('tp', 'fsdp', 'ddp' "
    "or None), the reference whole on every rank; a rank that fails, crashes, skips alone or hangs past "
    "timeout seconds fails the test"
)


@dataclass(frozen=True)
class ParallelSpec:
    """How a test runs on ``torch.distributed``: the sharding kind, the number of ranks, the time it may take."""

    kind: str | None = None
    world_size: int = DEFAULT_WORLD_SIZE
    timeout: float = DEFAULT_TIMEOUT

    def __str__(self) -> str:
        return f"parallel({self.kind!r}, world_size={self.world_size})"

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
        if options:
            raise PatchUsageError(
                f"@pytest.mark.parallel on {where} got unknown keyword(s) {sorted(options)}; it takes kind, world_size "
                "and timeout."
            )
        if kind not in KINDS:
            known = ", ".join(repr(k) for k in KINDS)
            raise PatchUsageError(f"@pytest.mark.parallel on {where}: unknown kind {kind!r}; use one of {known}.")
        if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 2:
            raise PatchUsageError(
                f"@pytest.mark.parallel on {where}: world_size must be an int of at least 2 (the ranks to run), "
                f"got {world_size!r}."
            )
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
            raise PatchUsageError(
                f"@pytest.mark.parallel on {where}: timeout must be a positive number of seconds, got {timeout!r}."
            )
        return cls(kind, world_size, float(timeout))
