"""The pytest side of parallel tests: a test marked ``parallel`` runs in the ranks, not here.

:class:`ParallelSession` is registered by ``plugin.py`` in every process that runs tests (each
pytest-xdist worker, or the single process), never in a rank. For a marked test it takes over
``pytest_runtest_protocol`` as xdist's controller does for its workers: it logs the test's start,
hands it to the pool of its world size and backend, logs the merged reports of the ranks
(:mod:`.outcomes`), and logs its end. Pools are started on first use and kept for the session.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import pytest

from pytest_modelpatch.errors import PatchUsageError, RankPoolError
from pytest_modelpatch.parallel.launcher import POOL_RANK_ENV, RANK_ZERO_ONLY, launched_rank
from pytest_modelpatch.parallel.marker import ParallelSpec
from pytest_modelpatch.parallel.outcomes import log_test, merge
from pytest_modelpatch.parallel.pool import RankOutcome, RankPool

RANK_ENV = POOL_RANK_ENV  # set in every rank process: the plugin there runs tests, it does not dispatch them


def in_rank() -> bool:
    """This process is a rank of a parallel test's pool, or of a launcher's job (torchrun, srun)."""
    return os.environ.get(RANK_ENV) is not None or launched_rank() is not None


def parallel_spec(item: pytest.Item) -> ParallelSpec | None:
    """The test's ``@pytest.mark.parallel``, validated; ``None`` when it has none."""
    mark = item.get_closest_marker("parallel")
    if mark is None:
        return None
    return ParallelSpec.from_marker(mark.args, mark.kwargs, item.nodeid)


# options that write the session's outputs: the process that sends the tests writes them, from the rows the
# ranks send back (a rank writing them would overwrite them); the seed is sent as this session's own
CONTROLLER_ONLY = frozenset({*RANK_ZERO_ONLY, "modelpatch_seed"})
_RANK_PLUGINS = ("xdist", "randomly", "cacheprovider")  # turned off in the ranks


def rank_arguments(config: pytest.Config, seed: int) -> list[str]:
    """The pytest arguments of a rank's session: this session's ini file and overrides, plugins and modelpatch options.

    The ranks judge as this process would: the same ini file (``-c``), every ``-o`` override, every
    ``-p`` plugin and ``-W`` filter, every ``--modelpatch-*`` option but those in
    :data:`CONTROLLER_ONLY`. They neither distribute (no xdist) nor reorder (no randomly): they run
    what they are sent. ``addopts`` is left out (it may hold ``-n``); it was applied here already.
    """
    given = config.known_args_namespace
    args = ["-p", "no:xdist", "-p", "no:randomly", "-p", "no:cacheprovider"]
    args += [a for name in given.plugins or [] if name.removeprefix("no:") not in _RANK_PLUGINS for a in ("-p", name)]
    if config.inipath is not None:
        args += ["-c", str(config.inipath)]
    args += [a for override in given.override_ini or [] for a in ("-o", override)]
    args += ["-o", "addopts=", "-q", f"--rootdir={config.rootpath}", f"--import-mode={config.getoption('importmode')}",
             f"--modelpatch-seed={seed}", *modelpatch_options(config)]  # fmt: skip
    for warning in given.pythonwarnings or []:
        args += ["-W", warning]
    if config.getoption("strict_markers", False):
        args.append("--strict-markers")
    return args


def modelpatch_options(config: pytest.Config) -> list[str]:
    """This session's ``--modelpatch-*`` options that a rank takes, as they would be written (``--modelpatch-x=v``)."""
    args = []
    for dest, value in sorted(vars(config.option).items()):
        if dest.startswith("modelpatch_") and dest not in CONTROLLER_ONLY and value not in (None, False, ""):
            flag = "--" + dest.replace("_", "-")
            args.append(flag if value is True else f"{flag}={value}")
    return args


class ParallelSession:
    """Runs this process's parallel tests in pools of ranks, one pool per (world size, backend).

    ``backend_of(item)`` names the test's backend (``gloo``, or ``nccl`` for a CUDA device) or
    skips it (no GPU, too few GPUs); ``rank_env()`` what the ranks' environment adds (where this
    session keeps its checkpoints, so ranks and workers share them); ``check(item, spec)`` raises
    ``PatchUsageError`` for a test that cannot shard as it asks (a tensor-parallel world size that
    does not divide the heads), before any rank starts. ``plugin.py`` gives all three, since
    devices, checkpoints and models are the fixtures' to resolve.
    """

    def __init__(
        self, config: pytest.Config, seed: int, backend_of: Callable[[pytest.Item, ParallelSpec], str],
        rank_env: Callable[[], dict[str, str]], check: Callable[[pytest.Item, ParallelSpec], None],
    ) -> None:  # fmt: skip
        self.config = config
        self.seed = seed
        self.backend_of = backend_of
        self.rank_env = rank_env
        self.check = check
        self.pools: dict[tuple[int, str], RankPool] = {}

    def pool(self, world_size: int, backend: str) -> RankPool:
        """The pool for ``world_size`` ranks on ``backend``: kept, or started (again, after a crash or a hang)."""
        key = (world_size, backend)
        pool = self.pools.get(key)
        if pool is None or pool.broken:
            pool = self.pools[key] = RankPool(
                world_size, backend, rank_arguments(self.config, self.seed), self.rank_env()
            )
        return pool

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_protocol(self, item: pytest.Item, nextitem: pytest.Item | None) -> bool | None:
        if item.get_closest_marker("parallel") is None:
            return None
        log_test(item, self._reports(item))
        return True

    def _reports(self, item: pytest.Item) -> list[pytest.TestReport]:
        setup = pytest.CallInfo.from_call(lambda: self._spec_and_backend(item), "setup")
        if setup.excinfo is not None:
            return [item.ihook.pytest_runtest_makereport(item=item, call=setup)]
        spec, backend = setup.result
        try:
            pool = self.pool(spec.world_size, backend)
        except RankPoolError as exc:
            outcome = RankOutcome(0, error=f"the ranks did not start: {exc}")
            return merge(item, spec, backend, [outcome], self._deserialize)
        outcomes = pool.run({"arg": _collect_arg(item), "nodeid": item.nodeid}, spec.timeout)
        return merge(item, spec, backend, outcomes, self._deserialize)

    def _spec_and_backend(self, item: pytest.Item) -> tuple[ParallelSpec, str]:
        try:
            spec = parallel_spec(item)
            assert spec is not None
            backend = self.backend_of(item, spec)
            self.check(item, spec)
        except PatchUsageError as exc:
            problem = str(exc)
        else:
            return spec, backend
        # the message says what to fix: one paragraph, no traceback through the plugin (nor the chained error)
        pytest.fail(f"PatchUsageError: {problem}", pytrace=False)

    def _deserialize(self, data: dict[str, Any]) -> pytest.TestReport:
        return self.config.hook.pytest_report_from_serializable(config=self.config, data=data)

    def close(self) -> None:
        for pool in self.pools.values():
            pool.close()
        self.pools.clear()

    def pytest_keyboard_interrupt(self) -> None:
        for pool in self.pools.values():  # Ctrl-C: the ranks are killed, not waited for
            pool.kill()

    def pytest_unconfigure(self, config: pytest.Config) -> None:
        self.close()


def _collect_arg(item: pytest.Item) -> str:
    """The command-line argument that collects ``item`` alone, from any working directory: its file's path and id."""
    _, _, rest = item.nodeid.partition("::")
    return f"{item.path}::{rest}" if rest else str(item.path)
