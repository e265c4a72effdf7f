"""Shared helpers for the plugin's own tests."""

from __future__ import annotations

import pytest

# The key scenarios run three ways: plain, under xdist with two workers, and with xdist disabled.
XDIST_MODES = [
    pytest.param((), id="plain"),
    pytest.param(("-n", "2", "--dist", "loadfile"), id="xdist-2"),
    pytest.param(("-p", "no:xdist"), id="no-xdist"),
]


@pytest.fixture(params=XDIST_MODES)
def xdist_args(request: pytest.FixtureRequest) -> tuple[str, ...]:
    """Extra command-line arguments selecting how a pytester run is distributed."""
    return request.param


TINY_LLAMA = """
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

LAYERS = 2


def tiny_llama_config(**overrides):
    values = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=LAYERS, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=128, max_position_embeddings=64)
    values.update(overrides)
    return LlamaConfig(**values)


@pytest.fixture(scope="session")
def llama_checkpoint(tmp_path_factory):
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("llama")
    LlamaForCausalLM(tiny_llama_config()).save_pretrained(path)
    return path
"""


@pytest.fixture
def tiny_llama_conftest(pytester: pytest.Pytester) -> None:
    """A conftest giving pytester runs a ``llama_checkpoint`` fixture (a saved tiny Llama)."""
    pytester.makeconftest(TINY_LLAMA)


REPO_ROOT = __import__("pathlib").Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _repo_on_pytester_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    # pytester runs are subprocesses (--runpytest=subprocess: torch cannot be re-imported
    # in-process); give them the repo root so they can import the `fixtures` package.
    if "pytester" in request.fixturenames:
        import os

        monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])))
        monkeypatch.setenv("OMP_NUM_THREADS", "1")
