"""How many transformers families build tiny and run a forward on CPU.

Tries every model type of the installed transformers that has a modeling class, stage by stage:
``tiny_config`` -> ``model_class_for`` -> seeded build (``seeded_model``, with the plugin's
non-degenerate init) -> one forward on ``example_inputs`` -> finite outputs -> what
``@pytest.mark.model(t)`` does (seeded checkpoint saved as safetensors, reference and patched
model loaded with ``from_pretrained`` by ``ModelBuilder``) -> ``assert_equivalent`` -> the
budget (at most ``PARAMETER_BUDGET`` parameters). Prints how many families reached each stage,
total time, the slowest families and a table of failures with the first line of each exception.

    python benchmarks/model_coverage.py            # every family
    python benchmarks/model_coverage.py llama bert  # just these
    python benchmarks/model_coverage.py --markdown  # just the counts block docs/families.md quotes
    python benchmarks/model_coverage.py --jobs 2    # the families split over 2 processes (CI's sweep)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import signal
import sys
import tempfile
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: measure this checkout's package, not whichever one is installed
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
from split_families import split_over_processes
from transformers.utils import logging as transformers_logging

from pytest_modelpatch.compare._engine.outputs import vacuous_outputs
from pytest_modelpatch.compare.forward.equivalence import assert_equivalent
from pytest_modelpatch.families.catalog import available_model_types, model_class_for, tiny_config
from pytest_modelpatch.families.inputs import example_inputs
from pytest_modelpatch.models.builder import ModelBuilder, ModelRequest
from pytest_modelpatch.models.checkpoints import seeded_model
from pytest_modelpatch.models.memory_cache import CacheBound

PER_TYPE_TIMEOUT_S = 60
PARAMETER_BUDGET = 5_000_000
STAGES = ("config", "class", "build", "inputs", "forward", "finite", "fixtures", "equivalent", "budget", "ok")


@dataclass
class CoverageRow:
    """One family's outcome: the stage it reached and why it stopped."""

    model_type: str
    stage: str  # the first of STAGES that failed, or "ok"
    seconds: float
    error: str = ""
    model_class: str = ""
    parameters: int = 0
    build_forward_s: float = 0.0  # seeded build plus one forward

    def __str__(self) -> str:
        where = f" {self.model_class}" if self.model_class else ""
        return f"{self.model_type:28s} {self.stage:8s}{where}: {self.error}"


class _Timeout(Exception):
    pass


def _alarm(signum: int, frame: Any) -> None:
    raise _Timeout(f"no result in {PER_TYPE_TIMEOUT_S}s")


def try_model_type(model_type: str, builder: ModelBuilder) -> CoverageRow:
    """Run the stages for one family; the row records the first that failed."""
    start = time.perf_counter()
    row = CoverageRow(model_type, "config", 0.0)
    signal.alarm(PER_TYPE_TIMEOUT_S)
    try:
        config = tiny_config(model_type)
        row.stage = "class"
        cls = model_class_for(config)
        row.model_class = cls.__name__
        row.stage = "build"
        built_at = time.perf_counter()
        model = seeded_model(config, model_class=cls)
        row.parameters = sum(p.numel() for p in model.parameters())
        row.stage = "inputs"
        inputs = example_inputs(config, model_class=cls)
        row.stage = "forward"
        with torch.no_grad():
            outputs = model(**inputs)
        row.stage = "finite"
        row.build_forward_s = time.perf_counter() - built_at
        bad = vacuous_outputs(outputs)
        if bad:
            raise FloatingPointError(f"NaN or no finite value in {', '.join(bad[:3])}")
        del model, outputs
        row.stage = "fixtures"
        request = ModelRequest(model_type)
        reference, patched = builder.reference(request), builder.patched(request, unpatched=True)  # stock vs stock
        row.stage = "equivalent"
        assert_equivalent(reference, patched)
        row.stage = "budget"
        if row.parameters > PARAMETER_BUDGET:
            raise ValueError(f"{row.parameters:,} parameters, over the budget of {PARAMETER_BUDGET:,}")
        row.stage = "ok"
    except BaseException as exc:  # a family may raise anything, even SystemExit-like errors
        if isinstance(exc, KeyboardInterrupt):
            raise
        lines = str(exc).strip().splitlines()
        row.error = f"{type(exc).__name__}: {lines[0][:160] if lines else ''}"
    finally:
        signal.alarm(0)
        row.seconds = time.perf_counter() - start
    return row


def run_here(types: list[str]) -> list[CoverageRow]:
    """Every family in this process, one after another (one model cached at a time)."""
    rows = []
    cache = tempfile.TemporaryDirectory(prefix="model-coverage-")
    builder = ModelBuilder(Path(cache.name), model_cache=CacheBound(count=1))
    for model_type in types:
        # transformers prints some of its own checks (PE-Video's docstring check, on every build):
        # stdout is the report, which docs/families.md quotes
        with contextlib.redirect_stdout(sys.stderr):
            rows.append(try_model_type(model_type, builder))
        print(f"  {rows[-1].stage:10s} {rows[-1].seconds:6.2f}s {model_type}", file=sys.stderr, flush=True)
    return rows


def run_split(types: list[str], jobs: int) -> list[CoverageRow]:
    """The families dealt round-robin to ``jobs`` processes of this script; rows back in ``types``' order."""
    return [CoverageRow(**row) for row in split_over_processes(__file__, types, jobs, ["--markdown"])]


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("types", nargs="*", help="model types (default: every one with a modeling class)")
    parser.add_argument("--markdown", action="store_true", help="print only the counts block docs/families.md quotes")
    parser.add_argument("--json", type=Path, help="write one row per family to this file")
    parser.add_argument("--jobs", type=int, default=1, help="processes to split the families over (default 1)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    transformers_logging.set_verbosity_error()
    signal.signal(signal.SIGALRM, _alarm)
    types = args.types or available_model_types()
    start = time.perf_counter()
    rows = run_split(types, args.jobs) if args.jobs > 1 else run_here(types)
    total = time.perf_counter() - start
    if args.json:
        args.json.write_text(json.dumps([asdict(row) for row in rows], indent=1))
    print(markdown(rows))
    if args.markdown:
        return 0
    print(f"\ntotal time:  {total:.1f}s (mean {total / max(len(rows), 1):.2f}s per type, imports included)")
    slow = [r for r in rows if r.stage == "ok" and r.build_forward_s > 1.0]
    print(
        f"build + one forward over 1 s: {', '.join(f'{r.model_type} {r.build_forward_s:.1f}s' for r in slow) or 'none'}"
    )
    print("slowest:", ", ".join(f"{r.model_type} {r.seconds:.1f}s" for r in sorted(rows, key=lambda r: -r.seconds)[:5]))
    failures = [r for r in rows if r.stage != "ok"]
    if failures:
        print(f"\nfailures ({len(failures)}): type, stage reached, class, first line of the exception")
        for row in failures:
            print(f"  {row}")
    return 0


def markdown(rows: list[CoverageRow]) -> str:
    """The per-stage counts as the table docs/families.md quotes (deterministic: no timings)."""
    passed = [r for r in rows if r.stage == "ok"]
    lines = ["| stage | families past it |", "| --- | --- |"]
    for index, stage in enumerate(STAGES[:-1]):
        count = sum(1 for r in rows if STAGES.index(r.stage) > index)
        lines.append(f"| {stage} | {count}/{len(rows)} |")
    lines.append(f"| **pass** | **{len(passed)}/{len(rows)}** |")
    biggest = max(passed, key=lambda r: r.parameters, default=None)
    if biggest is not None:
        lines += ["", f"Largest tiny model that passes: `{biggest.model_type}`, {biggest.parameters:,} parameters."]
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
