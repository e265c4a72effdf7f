"""``check_generation``: decoding equivalence over drawn prompts, shrunk to a minimal failing one.

Hypothesis draws the batch size, prompt lengths, padding side (left or none: decoder-only
models generate from left-padded batches) and ``max_new_tokens``; both models are built once.
Seeded like ``check_equivalence`` (``seed=``, else the session seed, else 0).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from hypothesis import HealthCheck, Phase, Verbosity, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st

from pytest_modelpatch.compare.decoding import (
    DecodingReport,
    check_cache_implementation,
    compare_decoding,
    decode_pair,
)
from pytest_modelpatch.compare.outputs import describe_inputs
from pytest_modelpatch.compare.same_model import check_same_model
from pytest_modelpatch.compare.tolerance import TolerancePolicy, resolve_tolerance
from pytest_modelpatch.families.strategies import model_inputs
from pytest_modelpatch.reporting.records import SETTINGS

DEFAULT_MAX_EXAMPLES = 10  # each example decodes: costlier than a forward


@dataclass
class GenerationPropertyReport:
    """How ``check_generation`` went: examples decoded, seed, and the minimal failing prompt if any."""

    reference: str
    patched: str
    seed: int
    max_examples: int
    examples: int = 0
    first_failure: int = 0
    max_abs_error: float = 0.0
    near_ties: int = 0
    failure: DecodingReport | None = None
    error: str = ""
    duration_s: float = 0.0

    @property
    def passed(self) -> bool:
        return self.failure is None and not self.error

    @property
    def header(self) -> str:
        return f"check_generation(seed={self.seed}, max_examples={self.max_examples})"

    def __str__(self) -> str:
        if self.passed:
            return (
                f"{self.header}: patched {self.patched} decodes like reference {self.reference} on {self.examples} "
                f"drawn prompt batches, max abs {self.max_abs_error:.3g}, {self.near_ties} near-tie(s); {self.duration_s:.2f}s"
            )
        head = (
            f"{self.header}: example {self.first_failure} failed; shrunk in {self.examples - self.first_failure} "
            f"more runs to the minimal prompts below (seed={self.seed} draws them again)"
        )
        return "\n".join([head, self.error or str(self.failure)])


def check_generation(
    reference: torch.nn.Module,
    patched: torch.nn.Module,
    *,
    max_examples: int | None = None,
    seed: int | None = None,
    max_batch_size: int = 3,
    max_prompt_len: int = 12,
    max_new_tokens: int = 8,
    padding: tuple[str, ...] = ("left", "none"),
    cache_implementation: str | None = None,
    atol: float | None = None,
    rtol: float | None = None,
    policy: str | TolerancePolicy | None = None,
) -> GenerationPropertyReport:
    """Decode both models from many drawn prompt batches; on failure, shrink to a minimal prompt.

    Example::

        check_generation(reference_model, patched_model, max_examples=20)
        check_generation(reference_model, patched_model, cache_implementation="static", max_new_tokens=4)
    """
    __tracebackhide__ = True
    check_same_model(reference, patched, "check_generation")
    check_cache_implementation(cache_implementation)
    spec = resolve_tolerance(atol, rtol, policy)
    report = GenerationPropertyReport(
        type(reference).__name__, type(patched).__name__,
        seed=seed if seed is not None else SETTINGS.seed or 0,  # the session seed the plugin set
        max_examples=max_examples or SETTINGS.max_examples or DEFAULT_MAX_EXAMPLES,
    )  # fmt: skip
    prompts = model_inputs(
        reference.config, max_batch_size=max_batch_size, max_seq_len=max_prompt_len, padding=padding, position_ids=False
    )
    failing: list[tuple[Mapping[str, Any], int]] = []
    start = time.perf_counter()

    @settings(
        max_examples=report.max_examples, database=None, deadline=None, derandomize=False,
        phases=(Phase.explicit, Phase.generate, Phase.shrink), suppress_health_check=list(HealthCheck),
        verbosity=Verbosity.quiet, report_multiple_bugs=False, print_blob=False,
    )  # fmt: skip
    @hypothesis_seed(report.seed)
    @given(prompts, st.integers(1, max_new_tokens))
    def one_example(example: Mapping[str, Any], new_tokens: int) -> None:
        report.examples += 1
        try:
            steps, _ = decode_pair(reference, patched, example, max_new_tokens=new_tokens,
                                cache_implementation=cache_implementation, spec=spec)  # fmt: skip
        except Exception:
            failing[:] = [(example, new_tokens)]
            report.first_failure = report.first_failure or report.examples
            raise
        if not all(s.passed for s in steps):
            # hypothesis replays the minimal example last, so this ends up holding it
            failing[:] = [(example, new_tokens)]
            report.first_failure = report.first_failure or report.examples
            raise _DecodeFailed()
        report.max_abs_error = max([report.max_abs_error, *(s.logits.max_abs for s in steps)])
        report.near_ties += sum(len(s.near_ties) for s in steps)

    try:
        one_example()
    except Exception as error:  # noqa: BLE001 - every failure is turned into the report
        if not failing:
            raise
        example, new_tokens = failing[0]
        if isinstance(error, _DecodeFailed):
            report.failure = compare_decoding(reference, patched, example, spec, max_new_tokens=new_tokens,
                                              cache_implementation=cache_implementation)  # fmt: skip
        else:
            report.error = f"minimal failing prompts: {describe_inputs(example)}\na model raised {type(error).__name__}: {error}"
        report.duration_s = time.perf_counter() - start
        _record(report)
        raise AssertionError(str(report)) from (None if isinstance(error, _DecodeFailed) else error)
    report.duration_s = time.perf_counter() - start
    _record(report)
    return report


def _record(report: GenerationPropertyReport) -> None:
    if report.failure is not None:
        report.failure.duration_s = report.duration_s
        report.failure.record(kind="decode", examples=report.examples, detail=str(report))
        return
    from pytest_modelpatch.reporting.records import CheckRecord, record_check

    record_check(
        CheckRecord(
            kind="decode", outcome="passed" if report.passed else "failed", model=report.reference,
            examples=report.examples, max_abs_error=report.max_abs_error, duration_s=report.duration_s,
            detail=report.error,
        )
    )  # fmt: skip


class _DecodeFailed(Exception):
    """Raised inside hypothesis for a decoding difference; the full report is built once, after shrinking."""
