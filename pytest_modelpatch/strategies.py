"""Hypothesis strategies for tests that write ``@given`` themselves: tiny configs and model inputs.

As ``hypothesis.strategies`` does, the strategies are plural nouns; ``check_*`` takes ``inputs=`` one
of them (``model_inputs(config, max_seq_len=8)``). The one-off builders (``tiny_config``,
``example_inputs``) are in :mod:`pytest_modelpatch.models`.
"""

from __future__ import annotations

from pytest_modelpatch import lazy_exports

_EXPORTS: dict[str, str] = {
    "tiny_configs": "families.strategies",
    "model_inputs": "families.strategies",
}

__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
