"""What a session set out to run: its test paths, the tests it selected and those it deselected.

``--modelpatch-report`` records it, so that a shard (pytest-split, ``-k``, ``-m``, ``--lf``: all
deselect through ``pytest_deselected``) is judged only on its share of a baseline, and the gate
over every shard's report on their union (:mod:`pytest_modelpatch.reporting.shards`). Under
xdist the workers collect, not the controller: each worker hands its selection over in
``workeroutput``, as pytest-cov hands over its data. The pytest side of reporting, like
``session.py``, which registers these objects.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

SELECTION_KEY = "modelpatch_selection"  # in a worker's workeroutput


def collection_paths(config: pytest.Config) -> list[str]:
    """The session's collection arguments as node-id prefixes relative to the rootdir (``""``: all of it).

    ``pytest tests/models docs/examples/test_verify_examples.py::test_x`` gives
    ``["tests/models", "docs/examples/test_verify_examples.py::test_x"]``. An argument that is not a
    path under the rootdir (``--pyargs``) takes in every test: no baseline check is left unexpected.
    """
    root = Path(config.rootpath).resolve()
    paths = []
    for arg in config.args:
        path, sep, rest = str(arg).partition("::")
        try:
            relative = (Path(config.invocation_params.dir) / path).resolve().relative_to(root).as_posix()
        except ValueError:
            return [""]
        relative = "" if relative == "." else relative
        paths.append(f"{relative}::{rest}" if sep else relative)
    return paths or [""]


class SelectionRecorder:
    """Hooks: the tests this process's collection kept and those it deselected; on a worker, sent to the controller."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self.selected: list[str] = []
        self.deselected: list[str] = []

    def pytest_deselected(self, items: list[pytest.Item]) -> None:
        # called once per plugin that deselects (-k, -m, --lf, pytest-split): gather them all
        self.deselected += [item.nodeid for item in items]

    @pytest.hookimpl(trylast=True)
    def pytest_collection_finish(self, session: pytest.Session) -> None:
        self.selected = [item.nodeid for item in session.items]
        workeroutput = getattr(self.config, "workeroutput", None)
        if workeroutput is not None:
            workeroutput[SELECTION_KEY] = {"selected": self.selected, "deselected": self.deselected}

    def received(self, selection: dict[str, Any] | None) -> None:
        """A worker's selection (every worker collects the same tests: the first to finish is kept)."""
        if selection and not self.selected and not self.deselected:
            self.selected, self.deselected = list(selection["selected"]), list(selection["deselected"])

    def selection(self) -> dict[str, Any]:
        """The report's ``selection``: ``paths``, ``selected`` and ``deselected`` node ids, sorted."""
        return {"paths": collection_paths(self.config), "selected": sorted(set(self.selected)),
                "deselected": sorted(set(self.deselected) - set(self.selected))}  # fmt: skip


class XdistSelection:
    """xdist-only hooks (registered on the controller only when xdist is loaded): take the workers' selection."""

    def __init__(self, recorder: SelectionRecorder) -> None:
        self.recorder = recorder

    def pytest_testnodedown(self, node: Any, error: Any) -> None:
        self.recorder.received(getattr(node, "workeroutput", {}).get(SELECTION_KEY))
