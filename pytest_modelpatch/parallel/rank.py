"""One rank: ``python -m pytest_modelpatch.parallel.rank --fd N --rank R ... -- PYTEST_ARGS``.

It joins the process group once, then runs one pytest session for as long as the pool lives:
collection is skipped at the start, and each test the controller sends is collected by its node
id and run through pytest's whole protocol (fixtures, the plugin's isolation and leak guard,
xfail, capture), its reports sent back serialized as pytest-xdist's workers send theirs. Session
fixtures live as long as the rank (pytest tears them down when the pool stops it); everything
narrower is torn down after each test.
"""

from __future__ import annotations

import argparse
import ctypes
import faulthandler
import os
import signal
import sys
import threading
import time
import traceback
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import Any

import pytest


class _KeepSession:
    """What pytest's teardown is told comes next: a test under the same session and nothing else.

    ``SetupState.teardown_exact(nextitem)`` tears down every node not on ``nextitem``'s chain, so
    the test's own fixtures (and its module's, class's, package's) go and session fixtures stay.
    """

    def __init__(self, session: pytest.Session) -> None:
        self.session = session

    def listchain(self) -> list[Any]:
        return [self.session]


class RankLoop:
    """The rank's pytest plugin: run each test the controller sends, send back its serialized reports."""

    def __init__(self, connection: Connection, group: Any) -> None:
        self.connection = connection
        self.group = group  # the pool's process group: every test must leave it as it found it
        self.reports: list[dict[str, Any]] = []

    @pytest.hookimpl(tryfirst=True)
    def pytest_collection(self, session: pytest.Session) -> bool:
        return True  # nothing is collected up front: each test is collected when it is sent

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        config = self.connection_config
        self.reports.append(config.hook.pytest_report_to_serializable(config=config, report=report))

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtestloop(self, session: pytest.Session) -> bool:
        self.connection_config = session.config
        while True:
            try:
                kind, request = self.connection.recv()
            except (EOFError, OSError):
                return True  # the controller is gone
            if kind == "stop":
                return True
            result = self._run(session, request)
            self.connection.send(result)
            if result[0] == "group":
                return True  # the group is gone: this rank can run no other parallel test, the pool starts anew

    def _run(self, session: pytest.Session, request: dict[str, Any]) -> tuple[str, Any]:
        self.reports = []
        try:
            items = session.perform_collect([request["arg"]], genitems=True)
        except Exception:  # noqa: BLE001 - a collection error is the test's result, sent back whole
            return "error", f"collecting {request['arg']} in the rank failed:\n{traceback.format_exc()}"
        found = [item for item in items if item.nodeid == request["nodeid"]]
        if len(found) != 1:
            return "error", (
                f"the rank collected {[i.nodeid for i in items]} for {request['arg']}, not {request['nodeid']} alone: "
                "collection must be the same in every process (parametrize from values, not from the environment)"
            )
        (item,) = found
        item.config.hook.pytest_runtest_protocol(item=item, nextitem=_KeepSession(session))
        problem = group_problem(self.group)
        if problem:
            return "group", {"reports": self.reports, "problem": problem}
        return "reports", self.reports


def group_problem(group: Any) -> str:
    """What a test did to the pool's process group ``group``, or ``""`` when it is intact."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return "destroyed the process group (torch.distributed.destroy_process_group())"
    if dist.group.WORLD is not group:
        return "replaced the process group (destroy_process_group() and init_process_group() again)"
    return ""


def _die_with_parent(parent: int) -> None:
    """End this rank when the controller ends, even while it waits in a collective."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, name="modelpatch-parent-watch", daemon=True).start()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pytest_modelpatch.parallel.rank")
    for name in ("--fd", "--rank", "--world-size", "--parent"):
        parser.add_argument(name, type=int, required=True)
    for name in ("--backend", "--store", "--stack-file"):
        parser.add_argument(name, required=True)
    parser.add_argument("pytest_args", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    _die_with_parent(args.parent)
    stacks = open(args.stack_file, "a")
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
    connection = Connection(args.fd)
    import torch.distributed as dist

    if args.backend == "nccl":
        import torch

        torch.cuda.set_device(args.rank % max(torch.cuda.device_count(), 1))
    dist.init_process_group(
        args.backend, init_method=f"file://{args.store}", rank=args.rank, world_size=args.world_size,
        timeout=timedelta(hours=1),  # a hang is the controller's to time out, with every rank's stack
    )  # fmt: skip
    connection.send(("ready", os.getpid()))
    pytest_args = [a for a in args.pytest_args if a != "--"]
    try:
        code = int(pytest.main(pytest_args, plugins=[RankLoop(connection, dist.group.WORLD)]))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return code


if __name__ == "__main__":
    status = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # the session and its fixtures are torn down: skip the interpreter's own teardown of torch's
    # modules, which takes seconds and which the controller would wait for at the end of every session
    os._exit(status)
