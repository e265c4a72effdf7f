"""The controller's side of the rank processes: start them once, hand them tests, notice what goes wrong.

A :class:`RankPool` keeps ``world_size`` rank processes (``python -m pytest_modelpatch.parallel.rank``)
joined in one process group, as torch's ``MultiProcContinuousTest`` keeps its group for a whole
class: a test pays neither the imports nor the group's set-up. Each rank talks to the controller
over a socket pair of its own (no port, no file name that two xdist workers could share); the
group meets through a ``FileStore`` in the pool's own folder.

What the pool watches, for every test (pytest-xdist reports a worker that dies rather than
waiting on it, and so does this):

- a rank that exits or is killed: its exit code or signal and the end of its output;
- a rank that does not finish within the test's timeout (a collective only some ranks entered):
  every unfinished rank's Python stack, dumped by ``faulthandler`` on ``SIGUSR1``;
- once a rank has failed, the others get a short grace to finish (they may wait in a collective
  the failed one never reached).

After a crash or a hang every rank of the pool is killed (its whole process group) and the next
test starts a new pool. Ranks also die with the controller (``PR_SET_PDEATHSIG`` and a watch on
their parent), so none outlives the session.
"""

from __future__ import annotations

import multiprocessing.connection
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pytest_modelpatch.errors import RankPoolError

GRACE_AFTER_FAILURE = 10.0  # seconds the other ranks get once one rank's test failed or crashed
START_TIMEOUT = 180.0  # seconds for a rank to import torch and join the group
STOP_TIMEOUT = 30.0


@dataclass
class RankOutcome:
    """What one rank did with one test: its serialized pytest reports, or how it ended without them."""

    rank: int
    reports: list[dict[str, Any]] = field(default_factory=list)  # pytest_report_to_serializable of each phase
    crashed: str = ""  # "exited with code 3", "was killed by SIGSEGV"
    hung: str = ""  # its Python stack when it had not finished in time
    output: str = ""  # the end of its stdout and stderr, for a rank that crashed or hung
    error: str = ""  # the rank could not run the test at all (it did not collect), with the reason
    group: str = ""  # what the test did to the pool's process group ("destroyed the process group ..."), if anything
    finished: float = 0.0  # time.time() when its result arrived

    @property
    def failed(self) -> bool:
        broken = self.crashed or self.hung or self.error or self.group
        return bool(broken) or any(r.get("outcome") == "failed" for r in self.reports)


class RankPool:
    """``world_size`` rank processes on ``backend``, started on creation; :meth:`run` hands them one test.

    Example::

        pool = RankPool(2, "gloo", rank_arguments, env={})
        outcomes = pool.run({"arg": "tests/test_tp.py::test_x", "nodeid": "tests/test_tp.py::test_x"}, timeout=60)
        pool.close()
    """

    def __init__(
        self, world_size: int, backend: str, pytest_args: list[str], env: dict[str, str] | None = None
    ) -> None:
        self.world_size = world_size
        self.backend = backend
        remove_abandoned(Path(tempfile.gettempdir()))
        self.directory = Path(tempfile.mkdtemp(prefix=FOLDER_PREFIX))
        (self.directory / OWNER_FILE).write_text(owner_identity(os.getpid()))
        self.processes: list[subprocess.Popen[bytes]] = []
        self.connections: list[multiprocessing.connection.Connection] = []
        self.broken = False
        try:
            self._start(pytest_args, env or {})
        except BaseException:
            self.kill()
            raise

    def _log(self, rank: int) -> Path:
        return self.directory / f"rank{rank}.log"

    def _stack_file(self, rank: int) -> Path:
        return self.directory / f"rank{rank}.stack"

    def _start(self, pytest_args: list[str], extra_env: dict[str, str]) -> None:
        store = self.directory / "store"
        for rank in range(self.world_size):
            ours, theirs = socket.socketpair()
            env = {
                **os.environ, **extra_env,
                "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(self.world_size),
                "LOCAL_WORLD_SIZE": str(self.world_size), "MODELPATCH_RANK": str(rank),
            }  # fmt: skip
            env.pop("PYTEST_XDIST_WORKER", None)  # a rank is not an xdist worker: one GPU per rank, not per worker
            env.pop("PYTEST_ADDOPTS", None)  # its options reach the rank as arguments; it may hold -n
            command = [
                sys.executable, "-m", "pytest_modelpatch.parallel.rank", "--fd", str(theirs.fileno()),
                "--rank", str(rank), "--world-size", str(self.world_size), "--backend", self.backend,
                "--store", str(store), "--stack-file", str(self._stack_file(rank)), "--parent", str(os.getpid()),
                "--", *pytest_args, f"--basetemp={self.directory / f'rank{rank}-tmp'}",
            ]  # fmt: skip
            with self._log(rank).open("wb") as log:
                process = subprocess.Popen(
                    command, pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                    env=env, start_new_session=True,
                )  # fmt: skip
            theirs.close()
            self.processes.append(process)
            self.connections.append(multiprocessing.connection.Connection(ours.detach()))
        deadline = time.monotonic() + START_TIMEOUT
        for rank, connection in enumerate(self.connections):
            message = self._receive(rank, connection, deadline)
            if message is None or message[0] != "ready":
                detail = self._ended(rank) or f"did not join the process group within {START_TIMEOUT:.0f} s"
                raise RankPoolError(
                    f"rank {rank} of {self.world_size} ({self.backend}) could not start: {detail}\n"
                    f"{self._output(rank) or '(no output)'}"
                )

    def _receive(self, rank: int, connection: multiprocessing.connection.Connection, deadline: float) -> Any:
        """The rank's next message, or ``None`` when it ended or the deadline passed."""
        while time.monotonic() < deadline:
            if connection.poll(min(0.2, max(0.0, deadline - time.monotonic()))):
                try:
                    return connection.recv()
                except (EOFError, OSError):
                    return None
            if self.processes[rank].poll() is not None and not connection.poll(0):
                return None
        return None

    def run(self, request: dict[str, Any], timeout: float) -> list[RankOutcome]:
        """Run one test in every rank; each rank's outcome, in rank order.

        Interrupted (Ctrl-C), it kills the ranks at once rather than wait for the test they run.
        """
        try:
            return self._run(request, timeout)
        except BaseException:
            self.kill()
            raise

    def _run(self, request: dict[str, Any], timeout: float) -> list[RankOutcome]:
        outcomes = {rank: RankOutcome(rank) for rank in range(self.world_size)}
        stack_sizes = {rank: _size(self._stack_file(rank)) for rank in outcomes}
        for connection in self.connections:
            connection.send(("run", request))
        pending = dict(enumerate(self.connections))
        deadline = time.monotonic() + timeout
        while pending:
            ready = multiprocessing.connection.wait(
                list(pending.values()), timeout=max(0.0, deadline - time.monotonic())
            )
            if not ready:
                break
            for waited in ready:
                rank, connection = next((r, c) for r, c in pending.items() if c is waited)
                outcome = outcomes[rank]
                try:
                    kind, payload = connection.recv()
                except (EOFError, OSError):
                    outcome.crashed = self._ended(rank, wait=5.0) or "closed its connection"
                    outcome.output = self._output(rank)
                else:
                    if kind == "error":
                        outcome.error = payload
                    elif kind == "group":  # it reported, then left: its group is gone
                        outcome.reports, outcome.group = payload["reports"], payload["problem"]
                    else:
                        outcome.reports = payload
                outcome.finished = time.time()
                del pending[rank]
                if outcome.failed:
                    deadline = min(deadline, time.monotonic() + min(GRACE_AFTER_FAILURE, timeout))
        if pending:
            self._dump_stacks(pending, outcomes, stack_sizes, timeout)
        if pending or any(o.crashed or o.group for o in outcomes.values()):
            self.kill()  # a rank that crashed or hung, or a group a test destroyed: the next test starts a new pool
        return [outcomes[rank] for rank in range(self.world_size)]

    def _dump_stacks(
        self, pending: dict[int, Any], outcomes: dict[int, RankOutcome], sizes: dict[int, int], timeout: float
    ) -> None:
        for rank in pending:
            try:
                os.kill(self.processes[rank].pid, signal.SIGUSR1)
            except ProcessLookupError:
                pass
        time.sleep(1.0)  # faulthandler writes from its signal handler
        failed = [r for r, o in outcomes.items() if r not in pending and o.failed]
        why = (f"did not finish within {min(GRACE_AFTER_FAILURE, timeout):g} s after rank {failed[0]} failed" if failed
               else f"did not finish within the test's timeout of {timeout:g} s")  # fmt: skip
        for rank in pending:
            outcome = outcomes[rank]
            stack = trim_stack(_read_from(self._stack_file(rank), sizes[rank]))
            outcome.hung = f"{why}; its Python stack:\n{stack or '(none dumped: it was not running Python code)'}"
            outcome.output = self._output(rank)
            outcome.finished = time.time()

    def _ended(self, rank: int, wait: float = 0.0) -> str:
        """How the rank's process ended ("exited with code 3", "was killed by SIGSEGV"), or "" while it runs."""
        process = self.processes[rank]
        try:
            code = process.wait(timeout=wait) if wait else process.poll()
        except subprocess.TimeoutExpired:
            code = None
        if code is None:
            return ""
        if code < 0:
            return f"was killed by {signal.Signals(-code).name}"
        return f"exited with code {code}"

    def _output(self, rank: int, lines: int = 40) -> str:
        text = self._log(rank).read_text(errors="replace") if self._log(rank).exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    def close(self) -> None:
        """Let the ranks finish their session (session fixtures torn down), then make sure none is left."""
        if not self.broken:
            for connection in self.connections:
                try:
                    connection.send(("stop", None))
                except OSError:
                    pass
            deadline = time.monotonic() + STOP_TIMEOUT
            for process in self.processes:
                try:
                    process.wait(timeout=max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pass
        self.kill()

    def kill(self) -> None:
        """Kill every rank and whatever it started (each rank leads a process group of its own)."""
        self.broken = True
        for process in self.processes:
            if process.poll() is None:
                try:
                    os.killpg(process.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    process.kill()
            try:
                process.wait(timeout=STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                pass
        for connection in self.connections:
            connection.close()
        self.connections = []
        _remove(self.directory)


# frames of the machinery under a test, not the test: a dumped stack stops before the first of them
_MACHINERY = ("/_pytest/", "/pluggy/", "pytest_modelpatch/parallel/rank.py")


def trim_stack(dump: str) -> str:
    """``faulthandler``'s dump of a rank, each thread cut where pytest's machinery starts (most recent call first).

    The rank's own parent-watching thread is left out: it is always there, waiting.
    """
    threads = [block for block in dump.strip().split("\n\n") if block.strip()]
    kept = []
    for block in threads:
        head, *frames = block.splitlines()
        if any("modelpatch-parent-watch" in f or "parallel/rank.py" in f and " in watch" in f for f in frames[:1]):
            continue
        cut = next((i for i, frame in enumerate(frames) if any(m in frame for m in _MACHINERY)), len(frames))
        kept.append("\n".join([head, *frames[:cut]] + (["  ... (pytest)"] if cut < len(frames) else [])))
    return "\n\n".join(kept)


def _size(path: Path) -> int:
    return path.stat().st_size if path.exists() else 0


def _read_from(path: Path, offset: int) -> str:
    if not path.exists():
        return ""
    with path.open("rb") as handle:
        handle.seek(offset)
        return handle.read().decode(errors="replace")


FOLDER_PREFIX = "modelpatch-ranks-"
OWNER_FILE = "owner"  # the pid and start time of the process whose pool the folder is


def owner_identity(pid: int) -> str:
    """``"PID START"``: the start time tells a live owner from a new process that reuses its pid ("" without /proc)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return f"{pid} "
    return f"{pid} {stat.rpartition(')')[2].split()[19]}"


def _owner_alive(text: str) -> bool:
    pid_text, _, started = text.strip().partition(" ")
    try:
        pid = int(pid_text)
        os.kill(pid, 0)
    except ValueError:
        return True  # not an owner file this code wrote: left alone
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return not started or owner_identity(pid) == f"{pid} {started}"


def remove_abandoned(root: Path) -> list[Path]:
    """Remove the pool folders under ``root`` whose owner process is dead (a controller killed with SIGKILL).

    A folder without an owner file (being created, or another version's) and one whose owner
    lives are left alone: pools of other sessions share the temporary folder. Returns what it removed.
    """
    removed = []
    for folder in root.glob(f"{FOLDER_PREFIX}*"):
        try:
            owner = (folder / OWNER_FILE).read_text()
        except OSError:
            continue
        if not _owner_alive(owner):
            _remove(folder)
            removed.append(folder)
    return removed


def _remove(directory: Path) -> None:
    import shutil

    shutil.rmtree(directory, ignore_errors=True)
