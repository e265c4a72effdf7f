"""pytest inside torchrun, srun or another launcher: the session joins the launcher's process group.

A launcher starts one pytest session per rank and sets ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``
and ``MASTER_PORT`` (torchrun adds ``LOCAL_RANK`` and ``TORCHELASTIC_RUN_ID``). Then no pool is
started: every rank collects the same tests and runs each ``parallel`` test itself, in lockstep
with the others, through the same fixtures and checks as a pool's rank. Around each one:

- before it, the ranks meet and compare which test each is about to run (a rank whose collection
  differs is named, rather than left waiting in a collective of another test);
- after it, each rank's reports are gathered (``all_gather_object`` over a gloo group whose timeout
  is the test's) and merged as the pool merges them (``outcomes.merge``); every rank logs the merged
  reports, so all agree on the verdict, and rank 0 prints it.

Tests without the marker run on rank 0 only (deselected on the others). Ranks other than 0 print
nothing (their terminal writes to ``os.devnull``) and write no report; what they disagree on is in
rank 0's merged report. Before each test a rank writes the test's node id to torchelastic's error
file (``TORCHELASTIC_ERROR_FILE``), so a rank that dies is named with its test in torchrun's summary.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from pytest_modelpatch.errors import PatchUsageError
from pytest_modelpatch.parallel.marker import ParallelSpec
from pytest_modelpatch.parallel.outcomes import log_test, merge
from pytest_modelpatch.parallel.pool import RankOutcome
from pytest_modelpatch.parallel.rank import group_problem

# what a launcher sets (torchrun, torch.distributed.launch, srun with them exported): env:// init reads these
LAUNCHER_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
POOL_RANK_ENV = "MODELPATCH_RANK"  # a rank of the plugin's own pool sets RANK too: it is not under a launcher
ERROR_FILE_ENV = "TORCHELASTIC_ERROR_FILE"
MEET_TIMEOUT = timedelta(hours=6)  # the other ranks wait here while rank 0 runs the single-process tests
END = "(the end of its session)"
GROUP_ADVICE = (
    "the ranks' process group is the launcher's and serves every parallel test after this one: a test must not call "
    "destroy_process_group() or init_process_group(); make a group of its own with dist.new_group(...) and destroy "
    "that one. The session stopped: no later parallel test can run in these ranks."
)
# options whose outputs rank 0 writes alone (another rank writing them would overwrite them)
RANK_ZERO_ONLY = ("modelpatch_report", "modelpatch_baseline", "modelpatch_update_baseline", "modelpatch_html")


@dataclass(frozen=True)
class LaunchedRank:
    """This process's place in the launcher's job, read from its environment."""

    rank: int
    world_size: int
    local_rank: int

    def __str__(self) -> str:
        return f"rank {self.rank} of {self.world_size}"


def launched_rank(environ: dict[str, str] | None = None) -> LaunchedRank | None:
    """This process's rank when a launcher started it (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``), else ``None``."""
    env = os.environ if environ is None else environ
    if env.get(POOL_RANK_ENV) is not None or not all(env.get(name) for name in LAUNCHER_ENV):
        return None
    try:
        rank, world_size = int(env["RANK"]), int(env["WORLD_SIZE"])
        local_rank = int(env.get("LOCAL_RANK", rank))
    except ValueError:
        raise PatchUsageError(
            f"the launcher's environment is not numbers: RANK={env['RANK']!r}, WORLD_SIZE={env['WORLD_SIZE']!r}, "
            f"LOCAL_RANK={env.get('LOCAL_RANK')!r}; start pytest with torchrun, or export them as integers."
        ) from None
    if not 0 <= rank < world_size:
        raise PatchUsageError(f"RANK={rank} is outside WORLD_SIZE={world_size}: the launcher's environment is wrong.")
    return LaunchedRank(rank, world_size, local_rank)


def keep_outputs_on_rank_zero(config: pytest.Config, launched: LaunchedRank) -> None:
    """Clear the options that write the session's outputs on every rank but 0 (its report is the one written)."""
    if launched.rank != 0:
        for dest in RANK_ZERO_ONLY:
            if hasattr(config.option, dest):
                setattr(config.option, dest, None)


class LauncherSession:
    """The pytest side of a session under a launcher: joins its group, runs parallel tests in lockstep.

    ``backend``: ``"nccl"`` when the session's device is CUDA, else ``"gloo"``. ``check(item, spec)``
    raises ``PatchUsageError`` for a test that cannot shard as it asks (as before a pool's ranks start).
    """

    def __init__(
        self,
        config: pytest.Config,
        launched: LaunchedRank,
        backend: str,
        check: Callable[[pytest.Item, ParallelSpec], None],
    ) -> None:
        self.config = config
        self.launched = launched
        self.backend = backend
        self.check = check
        self.meet_group: Any = None
        self.verdict_groups: dict[float, Any] = {}
        self.world: Any = None
        self.broken = ""  # why the ranks can no longer meet (one hung, or their tests differ): nothing more to wait for

    # -- the group ---------------------------------------------------------------------------------

    def join(self) -> None:
        """Join the launcher's process group once for the session (its own collectives run on the test's timeout)."""
        import torch.distributed as dist

        if self.backend == "nccl":
            import torch

            torch.cuda.set_device(self.launched.local_rank % max(torch.cuda.device_count(), 1))
        if not dist.is_initialized():
            dist.init_process_group(self.backend, init_method="env://", timeout=MEET_TIMEOUT)
        self.meet_group = dist.new_group(backend="gloo", timeout=MEET_TIMEOUT)
        self.world = dist.group.WORLD  # every test must leave it as it found it

    def _verdict_group(self, timeout: float) -> Any:
        # every rank runs the same parallel tests in the same order, so every rank creates the same groups
        import torch.distributed as dist

        if timeout not in self.verdict_groups:
            self.verdict_groups[timeout] = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout))
        return self.verdict_groups[timeout]

    def _meet(self, where: str, status: int = 0) -> list[tuple[str, int]]:
        """Where each rank is (the test it is about to run, or the end) and, at the end, its exit status."""
        import torch.distributed as dist

        places: list[Any] = [None] * self.launched.world_size
        dist.all_gather_object(places, (where, status), group=self.meet_group)
        return [(str(where), int(status)) for where, status in places]

    # -- pytest hooks ------------------------------------------------------------------------------

    def pytest_sessionstart(self, session: pytest.Session) -> None:
        if self.launched.rank != 0:
            _silence(self.config)
        self.join()

    def pytest_collection_modifyitems(self, config: pytest.Config, items: list[pytest.Item]) -> None:
        if self.launched.rank == 0:
            return
        # rank 0 alone runs the tests without the marker: one verdict, and no rank waits on a test it does not run
        single = [item for item in items if item.get_closest_marker("parallel") is None]
        if single:
            items[:] = [item for item in items if item.get_closest_marker("parallel") is not None]
            config.hook.pytest_deselected(items=single)

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_protocol(self, item: pytest.Item, nextitem: pytest.Item | None) -> bool | None:
        if item.get_closest_marker("parallel") is None:
            return None
        log_test(item, self._reports(item, nextitem))
        if self.broken:
            item.session.shouldstop = self.broken
        return True

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        _forget_current_test()
        self.session = session

    @pytest.hookimpl(trylast=True)
    def pytest_unconfigure(self, config: pytest.Config) -> None:
        # the last thing every rank does, after rank 0 printed its summary and wrote its report: a rank that
        # exits first must not have the launcher stop rank 0 while it still writes
        import torch.distributed as dist

        apart = ""
        session = getattr(self, "session", None)
        status = int(session.exitstatus) if session is not None else 0
        if not self.broken and self.meet_group is not None:
            try:  # a rank still expecting a parallel test learns that this one has none left
                places = self._meet(END, status)
            except Exception as exc:  # noqa: BLE001 - a rank gone or hung: the launcher reports it
                apart = f"the ranks did not meet at the end of the session: {exc}"
            else:
                if len({where for where, _ in places}) > 1:
                    apart = "the ranks ended apart: " + "; ".join(_where(r, p) for r, (p, _) in enumerate(places))
                status = places[0][1]
        if apart:
            _say(f"{self.launched}: {apart}")
        elif dist.is_initialized() and not self.broken:
            dist.destroy_process_group()
        if session is not None and self.launched.rank != 0:
            # every rank exits with rank 0's status, the verdict: a launcher whose ranks all fail, or all pass, ends
            # at once on every node (torchrun's agent whose ranks passed waits for the others at its exit barrier)
            session.exitstatus = pytest.ExitCode.TESTS_FAILED if (apart or self.broken) else status

    # -- one test ----------------------------------------------------------------------------------

    def _reports(self, item: pytest.Item, nextitem: pytest.Item | None) -> list[pytest.TestReport]:
        from _pytest.runner import runtestprotocol

        setup = pytest.CallInfo.from_call(lambda: self._spec(item), "setup")
        spec = setup.result if setup.excinfo is None else ParallelSpec()
        places = self._meet_before(item)
        if places is not None:
            return self._apart(item, spec, places)
        if setup.excinfo is not None:  # the same on every rank: it is decided from the marker and the model alone
            return [item.ihook.pytest_runtest_makereport(item=item, call=setup)]
        _name_current_test(item.nodeid, self.launched)
        reports = runtestprotocol(item, log=False, nextitem=nextitem)
        _forget_current_test()
        config = self.config
        mine = [config.hook.pytest_report_to_serializable(config=config, report=r) for r in reports]
        problem = group_problem(self.world)
        if problem:  # nothing left to gather over: this rank says what the test did, and the session stops
            self.broken = f"{item.nodeid} {problem}"
            _say(f"{self.launched}: {self.broken}")
            broke = RankOutcome(self.launched.rank, reports=mine, group=problem)
            return merge(item, spec, self.backend, [broke], self._deserialize, GROUP_ADVICE)
        import torch.distributed as dist

        gathered: list[Any] = [None] * self.launched.world_size
        try:
            dist.all_gather_object(gathered, mine, group=self._verdict_group(spec.timeout))
        except Exception as exc:  # noqa: BLE001 - a rank that did not finish in time: reported as the pool does
            self.broken = f"a rank did not finish {item.nodeid} within its timeout of {spec.timeout:g} s"
            _say(f"{self.launched}: {self.broken}: {exc}")
            hung = f"did not finish within the test's timeout of {spec.timeout:g} s, or left ({exc})"
            gathered = [mine if r == self.launched.rank else None for r in range(self.launched.world_size)]
            outcomes = [RankOutcome(r, reports=g) if g is not None else RankOutcome(r, hung=hung)
                        for r, g in enumerate(gathered)]  # fmt: skip
            return merge(item, spec, self.backend, outcomes, self._deserialize)
        outcomes = [RankOutcome(rank, reports=data) for rank, data in enumerate(gathered)]
        return merge(item, spec, self.backend, outcomes, self._deserialize)

    def _spec(self, item: pytest.Item) -> ParallelSpec:
        mark = item.get_closest_marker("parallel")
        assert mark is not None
        try:
            spec = ParallelSpec.from_marker(mark.args, dict(mark.kwargs), item.nodeid)
            if spec.world_size == self.launched.world_size:
                self.check(item, spec)
        except PatchUsageError as exc:
            problem = str(exc)
        else:
            if spec.world_size != self.launched.world_size:
                raise pytest.skip.Exception(  # located at the test, as a skipif mark's skip is
                    f"{spec} needs {spec.world_size} ranks and the launcher started {self.launched.world_size} "
                    f"(WORLD_SIZE={self.launched.world_size}): run it under a launcher of {spec.world_size} ranks, "
                    "or without a launcher (the plugin starts its own)",
                    _use_item_location=True,
                )
            return spec
        pytest.fail(f"PatchUsageError: {problem}", pytrace=False)

    def _meet_before(self, item: pytest.Item) -> list[str] | None:
        """Every rank's next test when they differ (``None`` when all are at ``item``)."""
        if self.broken:
            return [item.nodeid]
        try:
            places = [where for where, _ in self._meet(item.nodeid)]
        except Exception as exc:  # noqa: BLE001 - a rank gone: the launcher reports it
            self.broken = f"the ranks did not meet before {item.nodeid}: {exc}"
            _say(f"{self.launched}: {self.broken}")
            return [item.nodeid]
        if len(set(places)) == 1:
            return None
        self.broken = "the ranks' tests differ"
        _say(f"{self.launched}: before {item.nodeid}, " + "; ".join(_where(r, p) for r, p in enumerate(places)))
        return places

    def _apart(self, item: pytest.Item, spec: ParallelSpec, places: list[str]) -> list[pytest.TestReport]:
        if len(places) == 1:
            why = self.broken
        else:
            why = (
                "the ranks are not at the same test: " + "; ".join(_where(r, p) for r, p in enumerate(places)) + ". "
                "Every rank must collect the same parallel tests in the same order: parametrize from values, not from "
                "the environment, and run with -p no:randomly (or one -p randomly seed on every rank)"
            )
        outcome = RankOutcome(self.launched.rank, error=why)
        return merge(item, spec, self.backend, [outcome], self._deserialize)

    def _deserialize(self, data: dict[str, Any]) -> pytest.TestReport:
        return self.config.hook.pytest_report_from_serializable(config=self.config, data=data)


def _where(rank: int, place: str) -> str:
    return f"rank {rank} is at {place}"


def _silence(config: pytest.Config) -> None:
    """Send this rank's terminal output to ``os.devnull``: rank 0 prints the session's one verdict."""
    from _pytest.config import create_terminal_writer

    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        sink = open(os.devnull, "w")
        config.add_cleanup(sink.close)
        reporter._tw = create_terminal_writer(config, file=sink)


def _say(line: str) -> None:
    """One line on the real stderr, from any rank: what the launcher's log should show about the ranks."""
    print(f"modelpatch: {line}", file=sys.__stderr__, flush=True)


def _name_current_test(nodeid: str, launched: LaunchedRank) -> None:
    """Write the test into torchelastic's error file: a rank that dies during it is named with it by torchrun."""
    path = os.environ.get(ERROR_FILE_ENV)
    if not path:
        return
    message = f"{launched} ended while it ran {nodeid} (pytest-modelpatch names the test each rank starts)"
    # torchelastic's own format: its summary shows py_callstack as the rank's traceback
    data = {"message": {"message": message, "extraInfo": {"py_callstack": message, "timestamp": str(int(time.time()))}}}
    try:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(data))
    except OSError:
        pass


def _forget_current_test() -> None:
    path = os.environ.get(ERROR_FILE_ENV)
    if path:
        try:
            Path(path).unlink()
        except OSError:
            pass
