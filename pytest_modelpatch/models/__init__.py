"""The models a check compares: seeded checkpoints, the reference/patched builder, devices.

Owns resolving what ``@pytest.mark.model`` names (:mod:`.specs`), the checkpoint cache
(:mod:`.checkpoints`, :mod:`.cache`), non-degenerate weights, the
session's model builder (:mod:`.builder`) and its reference cache, device/dtype selection. What each family needs to be tiny and fed comes from
``families``. Imports ``errors``, ``families``, ``isolation`` (to build the reference with no
patches active) and ``lint``; never compare, reporting or roundtrip.

Public (docs/reference.md): tiny configs and inputs, seeded checkpoints, the builder, devices, ``patch_usage``.
"""

from __future__ import annotations

from pytest_modelpatch import lazy_exports

_EXPORTS: dict[str, str] = {
    "tiny_config": "families.catalog",
    "example_inputs": "families.inputs",
    "cached_checkpoint": "models.checkpoints",
    "load_pretrained": "models.checkpoints",
    "seeded_model": "models.checkpoints",
    "ModelBuilder": "models.builder",
    "ModelRequest": "models.builder",
    "patch_usage": "models.usage",
    "select_device": "models.devices",
    "CudaStatus": "models.devices",
    "xdist_worker_index": "models.devices",
}

__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
