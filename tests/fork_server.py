"""A warm interpreter that forks a fresh ``python -m pytest`` for each pytester run.

Most of a pytester subprocess run is importing torch and transformers (measured: 1.7 s of a 2.5 s
run of a one-line test). This server imports them once, then forks a child per run, which
takes the run's arguments, working directory, environment and standard streams and runs
pytest as ``python -m pytest`` would. The child is a new process whose only inheritance is
third-party modules already imported (as when a conftest imports torch at the top): the plugin,
the test files and everything else import in the child. ``conftest.py`` points pytester at
:data:`CLIENT`; a test marked ``fresh_interpreter`` (one about what a session imports) gets a
real new interpreter instead.

The server is single-threaded (forking a threaded process can leave locks held in the child):
one loop accepts runs, forks, reaps children, reports their exit status and kills a child
whose caller went away (pytester's timeout kills the caller). It exits with its parent.
"""

from __future__ import annotations

import ctypes
import os
import pickle
import selectors
import signal
import socket
import struct
import sys
from pathlib import Path

CLIENT = Path(__file__).with_name("fork_client.py")
# what a pytester run of this suite imports before its first test: loaded once in the server
PRELOAD = (
    "torch",
    "transformers",
    "transformers.modeling_utils",
    "transformers.models.llama.modeling_llama",
    "safetensors.torch",
)
_HEADER = struct.Struct("!I")


def send_message(sock: socket.socket, value: object, fds: list[int] | None = None) -> None:
    data = pickle.dumps(value)
    message = _HEADER.pack(len(data)) + data
    if fds:
        socket.send_fds(sock, [message], fds)
    else:
        sock.sendall(message)


def receive_message(sock: socket.socket, max_fds: int = 0) -> tuple[object, list[int]]:
    fds: list[int] = []
    head = b""
    while len(head) < _HEADER.size:
        if max_fds and not fds:
            chunk, fds, _, _ = socket.recv_fds(sock, _HEADER.size - len(head), max_fds)
        else:
            chunk = sock.recv(_HEADER.size - len(head))
        if not chunk:
            raise EOFError("connection closed")
        head += chunk
    (size,) = _HEADER.unpack(head)
    data = b""
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            raise EOFError("connection closed")
        data += chunk
    return pickle.loads(data), fds


def _die_with_parent() -> None:
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _run_child(request: dict, fds: list[int], inherited: list[socket.socket]) -> None:
    """In the forked child: become ``python -m pytest ARGS`` in the caller's directory, environment and streams."""
    for sock in inherited:  # the server's ends of other runs' connections
        sock.close()
    for target, fd in enumerate(fds[:3]):
        os.dup2(fd, target)
    for fd in fds:
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    # huggingface_hub imports anyio (through httpx), a pytest plugin's package: pytest warns that
    # it cannot rewrite a plugin imported before it starts, so the run imports its own anyio
    for name in [n for n in sys.modules if n == "anyio" or n.startswith("anyio.")]:
        del sys.modules[name]
    # what a new interpreter does with PYTHONPATH and `-m` (sys.path[0] is the working directory)
    entries = [p for p in request["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:] = [request["cwd"], *entries, *(p for p in sys.path[1:] if p not in entries)]
    import random

    random.seed()  # a new interpreter seeds from the OS; a fork would share the server's state
    args = list(request["args"])
    if args[:1] == ["--python"]:  # `python -u -c CODE`: an xdist worker's bootstrap (execnet), see below
        _exit_after(lambda: _run_python_c(args[1:]))
    sys.argv = [sys.executable, *args]
    sys.stdout = os.fdopen(1, "w", buffering=1, closefd=False)
    sys.stderr = os.fdopen(2, "w", buffering=1, closefd=False)
    sys.stdin = os.fdopen(0, "r", closefd=False)

    def run_pytest() -> object:
        import execnet.gateway_io
        import pytest

        # the run's xdist workers are `python -u -c BOOTSTRAP` too: forked from this server as well
        popen_args = execnet.gateway_io.popen_args
        execnet.gateway_io.popen_args = lambda spec: [sys.executable, str(CLIENT), "--python", *popen_args(spec)[1:]]
        return pytest.console_main()

    _exit_after(run_pytest)


def _run_python_c(args: list[str]) -> None:
    """``python -u -c CODE``: unbuffered standard streams, ``sys.argv == ["-c"]``, CODE run as ``__main__``."""
    import io

    assert args[0] == "-u" and args[-2] == "-c", args
    sys.stdin = io.TextIOWrapper(os.fdopen(0, "rb", buffering=0, closefd=False))
    sys.stdout = io.TextIOWrapper(os.fdopen(1, "wb", buffering=0, closefd=False), write_through=True)
    sys.stderr = io.TextIOWrapper(os.fdopen(2, "wb", buffering=0, closefd=False), write_through=True)
    sys.argv = ["-c"]
    sys.path[0] = ""
    exec(compile(args[-1], "<string>", "exec"), {"__name__": "__main__"})


def _exit_after(run: object) -> None:
    """Run ``run()`` as an interpreter's main program would, then exit the process with its status."""
    code = 1
    try:
        result = run()
        code = result if isinstance(result, int) else 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:  # noqa: BLE001 - report it the way the interpreter would, then exit
        import traceback

        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def serve(path: str) -> None:
    _die_with_parent()
    parent = os.getppid()
    for name in PRELOAD:
        __import__(name)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(16)
    print("ready", flush=True)
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ)
    running: dict[int, socket.socket] = {}  # child pid -> its caller's connection
    while os.getppid() == parent:
        for key, _ in selector.select(timeout=0.02):
            if key.fileobj is listener:
                connection, _ = listener.accept()
                request, fds = receive_message(connection, max_fds=3)
                pid = os.fork()
                if pid == 0:
                    _run_child(request, fds, [listener, connection, *running.values()])  # never returns
                for fd in fds:
                    os.close(fd)
                running[pid] = connection
                selector.register(connection, selectors.EVENT_READ, pid)
            else:  # the caller closed its end before its child finished: it was killed (a timeout)
                pid = key.data
                selector.unregister(key.fileobj)
                key.fileobj.close()
                running.pop(pid, None)
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        while running:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            connection = running.pop(pid, None)
            if connection is not None:
                selector.unregister(connection)
                try:
                    send_message(connection, os.waitstatus_to_exitcode(status))
                except OSError:
                    pass
                connection.close()
    for pid in running:
        os.kill(pid, signal.SIGKILL)


class ForkServer:
    """The server process of one test session (one per xdist worker), started on first use."""

    def __init__(self, directory: Path) -> None:
        import subprocess

        self.path = str(directory / "fork.sock")
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).parent), os.environ.get("PYTHONPATH")])),
        }
        self.process = subprocess.Popen(
            [sys.executable, "-c", "import sys, fork_server; fork_server.serve(sys.argv[1])", self.path],
            stdout=subprocess.PIPE, env=env,
        )  # fmt: skip
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        if line.strip() != b"ready":
            raise RuntimeError(f"the fork server did not start: {line!r}")

    def close(self) -> None:
        self.process.kill()
        self.process.wait(timeout=30)
        if self.process.stdout is not None:  # else its pipe is closed by the garbage collector, a ResourceWarning
            self.process.stdout.close()
