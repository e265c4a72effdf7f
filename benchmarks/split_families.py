"""Deal families round-robin to several processes of a benchmark script and gather their rows back.

Each family's figures do not depend on the families run before it in its process (every build is
seeded), so the rows equal a single process's, in a fraction of the time.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any


def split_over_processes(script: str, types: list[str], jobs: int, args: list[str]) -> list[dict[str, Any]]:
    """Rows of ``script --json OUT *args <its share of types>`` over ``jobs`` processes, in ``types``' order.

    Each row is a dict with a ``model_type``; a process that fails stops the run with its command.
    """
    with tempfile.TemporaryDirectory(prefix="split-families-") as scratch:
        outputs = [Path(scratch) / f"rows-{job}.json" for job in range(jobs)]
        workers = [subprocess.Popen([sys.executable, script, "--json", str(out), *args, *types[job::jobs]],
                                    stdout=subprocess.DEVNULL)
                   for job, out in enumerate(outputs) if types[job::jobs]]  # fmt: skip
        failed = [worker.args for worker in workers if worker.wait() != 0]
        if failed:
            raise SystemExit(f"a process of {Path(script).name} failed: {failed[0][:5]}...")
        found = {row["model_type"]: row for out in outputs if out.exists() for row in json.loads(out.read_text())}
    return [found[model_type] for model_type in types]
