"""Shared helpers for the plugin's own tests."""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Iterator
from typing import Any

import pytest

Pair = tuple[Any, Any]  # (reference model, patched model)

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


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "tests_ordering: a pytester run that keeps pytest-randomly (not -p no:randomly)")
    config.addinivalue_line(
        "markers",
        "fresh_interpreter: pytester runs start a new interpreter, not a fork of the warm one (tests of what a session imports)",
    )


@pytest.fixture(scope="session")
def _fork_server() -> Iterator[Any]:
    """The warm interpreter pytester runs are forked from (``fork_server.py``), one per session and xdist worker."""
    import tempfile

    from fork_server import ForkServer

    directory = tempfile.mkdtemp(prefix="modelpatch-fork-")  # short: a socket path has at most 107 characters
    server = ForkServer(__import__("pathlib").Path(directory))
    yield server
    server.close()
    __import__("shutil").rmtree(directory, ignore_errors=True)


REPO_ROOT = __import__("pathlib").Path(__file__).resolve().parents[1]
CLIENT = REPO_ROOT / "tests" / "fork_client.py"


@pytest.fixture
def _modules_outlive_pytester() -> Iterator[dict[str, Any]]:
    """Put back, after pytester's teardown, the modules the test imported in this process.

    pytester drops every module first imported while it was active. Our runs are subprocesses,
    so what the test imported here is torch, transformers and the plugin's own lazy imports:
    dropped, the next test re-imports torch's C extensions ("SystemError: bad call flags").
    """
    imported: dict[str, Any] = {}
    yield imported
    for name, module in imported.items():
        sys.modules.setdefault(name, module)


@pytest.fixture(autouse=True)
def _repo_on_pytester_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    # pytester runs are subprocesses (--runpytest=subprocess: torch cannot be re-imported
    # in-process); give them the repo root so they can import the `fixtures` package.
    if "pytester" not in request.fixturenames:
        yield
        return
    imported = request.getfixturevalue("_modules_outlive_pytester")  # set up before pytester: torn down after
    pytester = request.getfixturevalue("pytester")  # first: pytester clears PYTEST_ADDOPTS when it starts

    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    if (
        request.node.get_closest_marker("fresh_interpreter") is None
        and os.environ.get("MODELPATCH_FORK_SERVER") != "off"
    ):
        # `python -m pytest` forked from a server that imported torch and transformers once (fork_server.py)
        server = request.getfixturevalue("_fork_server")
        monkeypatch.setattr(pytester, "_getpytestargs", lambda: (sys.executable, str(CLIENT)))
        monkeypatch.setenv("MODELPATCH_FORK_SERVER", server.path)
    if request.node.get_closest_marker("tests_ordering") is None:
        # Runs inherit pytest-randomly when it is installed; their expected outcomes assume
        # file order (test_a registers, test_b sees it cleaned up). One place for every run.
        addopts = os.environ.get("PYTEST_ADDOPTS", "")
        monkeypatch.setenv("PYTEST_ADDOPTS", f"{addopts} -p no:randomly".strip())
    yield
    here = str(pytester.path)
    imported.update((name, module) for name, module in list(sys.modules.items())
                    if not str(getattr(module, "__file__", None) or "").startswith(here))  # fmt: skip


@pytest.fixture(scope="session")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """``pair(patch_name, *, mapping="MAPPING", dtype="float32", attn_implementation=None, **config_overrides)``.

    The reference (no patches) and the patched model of a ``fixtures.patches`` example,
    both ``from_pretrained`` of one seeded checkpoint; built once per argument set.
    """
    from fixtures import load_patch, tiny_config
    from pytest_modelpatch.models.checkpoints import cached_checkpoint

    cache = tmp_path_factory.mktemp("checkpoints")

    @functools.cache
    def build(
        name: str,
        mapping: str = "MAPPING",
        dtype: str = "float32",
        attn_implementation: str | None = None,
        **config: Any,
    ) -> tuple[Any, Any]:
        patch = load_patch(name)
        path = cached_checkpoint(tiny_config(patch.MODEL_TYPE, **config), dtype=dtype, cache_dir=cache)
        extra = {"attn_implementation": attn_implementation} if attn_implementation else {}
        return load_pair(path, patch, mapping=mapping, dtype=dtype, **extra)

    return build


def load_pair(path: Any, patch: Any, *, mapping: str = "MAPPING", dtype: str = "float32", **load_kwargs: Any) -> Any:
    """Reference and patched model of ``path``, with ``patch``'s mapping and conversions registered for the load."""
    from transformers.conversion_mapping import register_checkpoint_conversion_mapping
    from transformers.monkey_patching import register_patch_mapping

    from pytest_modelpatch.isolation.guard import builtin_patch_state, isolated_patch_state
    from pytest_modelpatch.models.checkpoints import load_pretrained

    with isolated_patch_state():
        register_patch_mapping(getattr(patch, mapping))
        for model_type, transforms in patch.CONVERSIONS.items():
            register_checkpoint_conversion_mapping(model_type, transforms, overwrite=True)
        with builtin_patch_state():
            reference = load_pretrained(path, dtype=dtype, **load_kwargs)
        return reference, load_pretrained(path, dtype=dtype, **load_kwargs)


@pytest.fixture
def records() -> Any:
    """The CheckRecords the code under test records, in order."""
    from pytest_modelpatch.reporting.records import set_record_sink

    rows: list[Any] = []
    previous = set_record_sink(rows.append)
    yield rows
    set_record_sink(previous)


def cache_field() -> str:
    """The KV cache's name in model outputs and forwards: ``cache`` from transformers 5.24, ``past_key_values`` before."""
    from transformers.modeling_outputs import CausalLMOutputWithPast

    return "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"
