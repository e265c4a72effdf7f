"""Device and dtype selection for the ``device``/``dtype`` fixtures and markers.

The selection logic is pure (it takes whether CUDA is there and how many GPUs
as arguments) so every GPU path is testable on a machine without one; only
``cuda_status()`` touches torch, and only when a test asks for a GPU. Beside it, what a model on
a device draws from: ``first_parameter_device``, ``seed_generators`` and ``seeded_generators``
(torch imported when they run).
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from pytest_modelpatch.errors import PatchUsageError

DEVICE_ENV = "MODELPATCH_DEVICE"
_DEVICE_RE = re.compile(r"^(cpu|cuda|auto|meta|mps|xpu)(:\d+)?$")

# accepted spellings -> torch attribute name
DTYPE_ALIASES: dict[str, str] = {
    "float32": "float32", "fp32": "float32", "float": "float32",
    "float16": "float16", "fp16": "float16", "half": "float16",
    "bfloat16": "bfloat16", "bf16": "bfloat16",
    "float64": "float64", "fp64": "float64", "double": "float64",
}  # fmt: skip


def parse_device(value: str) -> str:
    """Validate a device name (``cpu``, ``cuda``, ``cuda:1``, ``auto``); return it normalized."""
    name = str(value).strip().lower()
    if not _DEVICE_RE.match(name) or name.startswith("auto:"):
        raise PatchUsageError(
            f"unknown device {value!r}: use cpu, cuda, cuda:N or auto (cuda when available, else cpu)."
        )
    return name


def dtype_name(value: Any) -> str:
    """The canonical name (``float32``, ``bfloat16``...) of a dtype given as a string or ``torch.dtype``."""
    text = str(value).strip().lower().removeprefix("torch.")
    if text not in DTYPE_ALIASES:
        raise PatchUsageError(
            f"unknown dtype {value!r}: use one of {', '.join(sorted(set(DTYPE_ALIASES.values())))} "
            f"(or the aliases {', '.join(k for k in DTYPE_ALIASES if k not in DTYPE_ALIASES.values())})."
        )
    return DTYPE_ALIASES[text]


def to_torch_dtype(value: Any) -> Any:
    """``torch.dtype`` for a name or dtype, e.g. ``to_torch_dtype("bf16") is torch.bfloat16``."""
    import torch

    return getattr(torch, dtype_name(value))


def xdist_worker_index(env: Mapping[str, str] = os.environ) -> int | None:
    """This process's pytest-xdist worker number (``gw3`` -> 3), or ``None`` outside xdist."""
    worker = env.get("PYTEST_XDIST_WORKER", "")
    match = re.fullmatch(r"gw(\d+)", worker)
    return int(match.group(1)) if match else None


def requested_device(option: str | None, env: Mapping[str, str] = os.environ) -> str:
    """The default device: ``--modelpatch-device``, else ``$MODELPATCH_DEVICE``, else ``cpu``."""
    if option:
        return parse_device(option)
    if env.get(DEVICE_ENV):
        try:
            return parse_device(env[DEVICE_ENV])
        except PatchUsageError as exc:
            raise PatchUsageError(f"${DEVICE_ENV}: {exc}") from None
    return "cpu"


@dataclass(frozen=True)
class CudaStatus:
    """What the selection logic needs to know about CUDA on this machine."""

    available: bool
    device_count: int


def cuda_status() -> CudaStatus:
    """Ask torch (imported here, only when a test needs a GPU decision)."""
    import torch

    available = bool(torch.cuda.is_available())
    return CudaStatus(available, torch.cuda.device_count() if available else 0)


def select_device(requested: str, cuda: CudaStatus, worker: int | None) -> str:
    """Resolve ``auto`` and spread bare ``cuda`` over the GPUs, one per xdist worker.

    Example: ``select_device("cuda", CudaStatus(True, 4), worker=5) == "cuda:1"``.
    """
    if requested == "auto":
        requested = "cuda" if cuda.available else "cpu"
    if requested == "cuda" and worker is not None and cuda.device_count > 1:
        return f"cuda:{worker % cuda.device_count}"
    return requested


def needs_gpu(device: str) -> bool:
    """Whether running on ``device`` needs a CUDA GPU."""
    return device.startswith("cuda")


def gpu_missing_reason(device: str, cuda: CudaStatus) -> str | None:
    """Why ``device`` cannot run here (to skip or fail with), or ``None`` if it can."""
    if not cuda.available:
        return f"needs a CUDA GPU for device {device!r}, and torch.cuda.is_available() is False on this machine"
    index = device.partition(":")[2]
    if index and int(index) >= cuda.device_count:
        return f"needs {device}, but this machine has {cuda.device_count} CUDA device(s)"
    return None


def parallel_gpu_problem(world_size: int, cuda: CudaStatus) -> str | None:
    """Why ``world_size`` ranks cannot each have a GPU here (nccl needs one per rank), or ``None``.

    Example: ``parallel_gpu_problem(2, CudaStatus(True, 1))`` names the missing GPU.
    """
    if cuda.device_count >= world_size:
        return None
    return f"needs a CUDA GPU for each of its {world_size} ranks (nccl), and this machine has {cuda.device_count}"


def first_parameter_device(model: Any) -> Any:
    """The ``torch.device`` of the model's first parameter (the CPU when it has none)."""
    import torch

    first = next(model.parameters(), None)
    return first.device if first is not None else torch.device("cpu")


def seed_generators(device: Any, seed: int) -> None:
    """Seed the generators a model on ``device`` draws from: the CPU's, and its accelerator's.

    Not ``torch.manual_seed``, which seeds every backend there is and costs more than a tiny
    model's forward on a machine without them: a training check seeds twice a step.
    """
    import torch

    torch.default_generator.manual_seed(seed)
    if device.type == "cuda":
        with torch.cuda.device(device):
            torch.cuda.manual_seed(seed)
    elif device.type != "cpu":  # another accelerator: its own generator, through torch's own call
        torch.manual_seed(seed)


@contextmanager
def seeded_generators(device: Any, seed: int) -> Iterator[None]:
    """Those generators seeded with ``seed`` for the block, and put back as the caller had them after."""
    import torch

    accelerator = device.type != "cpu"
    with torch.random.fork_rng(
        devices=[device] if accelerator else [], device_type=device.type if accelerator else "cuda"
    ):
        seed_generators(device, seed)
        yield
