"""Fixtures the documentation's examples use.

``tests/test_docs.py`` installs this file as the conftest of every run of the docs'
test-module blocks; ``pytest docs/examples`` loads it too.
"""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def llama_checkpoint(model_builder) -> Path:
    """A seeded tiny Llama checkpoint directory (safetensors), saved once per session.

    Example::

        def test_roundtrip(roundtrip, llama_checkpoint):
            roundtrip.check(llama_checkpoint)
    """
    from pytest_modelpatch.models import ModelRequest

    return model_builder.checkpoint(ModelRequest("llama"))
