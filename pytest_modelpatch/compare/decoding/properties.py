"""``check_decodes_equivalent``: decoding equivalence over drawn prompts, shrunk to a minimal failing one.

Hypothesis draws the batch size, prompt lengths, padding side (left or none: decoder-only
models generate from left-padded batches) and ``max_new_tokens``; both models are built once.
Seeded like ``check_equivalent`` (``seed=``, else the session seed, else 0).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from hypothesis import strategies as st
from hypothesis.strategies import SearchStrategy

from pytest_modelpatch.compare._engine.devices import unwrapped
from pytest_modelpatch.compare._engine.inputs import describe_inputs
from pytest_modelpatch.compare._engine.property_loop import PropertyLoop, PropertyOutcome
from pytest_modelpatch.compare._engine.reports import conclude
from pytest_modelpatch.compare._engine.same_model import require_same_model
from pytest_modelpatch.compare._engine.tolerance import TolerancePolicy, resolve_tolerance
from pytest_modelpatch.compare.decoding.equivalence import (
    compare_decoding,
    decode_pair,
    validate_cache_implementation,
)
from pytest_modelpatch.errors import PatchUsageError
from pytest_modelpatch.families.strategies import DrawnBytes, drawn_bytes, model_inputs
from pytest_modelpatch.models.usage import patch_usage, unused_message
from pytest_modelpatch.settings import SETTINGS

DEFAULT_MAX_EXAMPLES = 10  # each example decodes: costlier than a forward


@dataclass
class DecodingPropertyReport(PropertyOutcome):
    """How ``check_decodes_equivalent`` went: prompt batches decoded, near-ties, and the minimal failing prompt if any.

    ``failure`` is the minimal prompt's DecodingReport.
    """

    row_kind = "decode"

    near_ties: int = 0

    @property
    def header(self) -> str:
        return f"check_decodes_equivalent(seed={self.seed}, max_examples={self.max_examples})"

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


def check_decodes_equivalent(
    reference: torch.nn.Module,
    patched: torch.nn.Module,
    *,
    inputs: SearchStrategy[dict[str, torch.Tensor]] | None = None,
    max_examples: int | None = None,
    seed: int | None = None,
    max_new_tokens: int = 8,
    cache_implementation: str | None = None,
    atol: float | None = None,
    rtol: float | None = None,
    policy: str | TolerancePolicy | None = None,
    allow_unused: bool = False,
) -> DecodingPropertyReport:
    """Decode both models from many drawn prompt batches; on failure, shrink to a minimal prompt.

    ``inputs=``: a ``model_inputs`` strategy of prompt batches (default: ``model_inputs(config,
    max_seq_len=12, padding=("left", "none"), position_ids=False)``: decoding appends on the right,
    so no right padding). A replacement class that ran in none of the examples fails the check,
    unless ``allow_unused=True``.

    Example::

        check_decodes_equivalent(reference_model, patched_model, max_examples=20)
        check_decodes_equivalent(reference_model, patched_model, cache_implementation="static", max_new_tokens=4)
        check_decodes_equivalent(ref, pat, inputs=model_inputs(ref.config, max_seq_len=32, padding="left"))
    """
    __tracebackhide__ = True
    require_same_model(reference, patched, "check_decodes_equivalent")
    validate_cache_implementation(cache_implementation)
    spec = resolve_tolerance(atol, rtol, policy)
    report = DecodingPropertyReport(
        type(reference).__name__, type(patched).__name__,
        seed=seed if seed is not None else SETTINGS.seed or 0,  # the session seed the plugin set
        max_examples=max_examples or DEFAULT_MAX_EXAMPLES,
    )  # fmt: skip
    prompts = _prompts(reference, inputs)
    loop = PropertyLoop(report.seed, report.max_examples)
    options: dict[str, Any] = {"cache_implementation": cache_implementation, "spec": spec}
    # replacement classes that have run in no example yet; once all have, no example needs to look
    unran = {u.replacement for u in patch_usage(unwrapped(patched)) if u.instances}

    def decode_one(drawn: tuple[Mapping[str, Any], int]) -> bool:
        example, new_tokens = drawn
        steps, _ = decode_pair(reference, patched, example, max_new_tokens=new_tokens, **options)
        if not all(s.passed for s in steps):
            return False
        report.max_abs_error = max([report.max_abs_error, *(s.logits.max_abs for s in steps)])
        report.near_ties += sum(len(s.near_ties) for s in steps)
        if unran:
            unran.difference_update(u.replacement for u in patch_usage(unwrapped(patched)) if u.calls_in_last_forward)
        return True

    failure = loop.run(_with_new_tokens(prompts, max_new_tokens), decode_one)
    report.counted(loop)
    if failure is not None:
        example, new_tokens = failure.minimal
        if failure.raised is None:
            report.failure = compare_decoding(reference, patched, example, max_new_tokens=new_tokens, **options)
        else:
            report.error = (
                f"minimal failing prompts: {describe_inputs(example)}\n"
                f"a model raised {type(failure.raised).__name__}: {failure.raised}"
            )
    elif unran and not allow_unused:
        report.error = unused_message(sorted(unran), where=f"any of the {report.examples} decoded prompt batches")
    report.duration_s = loop.elapsed()
    return conclude(report, report.to_record(), failure.raised if failure is not None else None)


def _prompts(reference: torch.nn.Module, inputs: Any) -> SearchStrategy[dict[str, torch.Tensor]]:
    """The prompt batches to decode: ``inputs`` when it is a ``model_inputs`` strategy, else the default."""
    if inputs is None:
        return model_inputs(reference.config, max_seq_len=12, padding=("left", "none"), position_ids=False)
    if isinstance(inputs, SearchStrategy) and drawn_bytes(inputs) is not None:
        return inputs
    raise PatchUsageError(
        f"check_decodes_equivalent: inputs= must be a model_inputs strategy of prompt batches (got "
        f"{type(inputs).__name__}): each prompt is drawn as bytes so that a failure shrinks to a minimal prompt; "
        "e.g. inputs=pytest_modelpatch.strategies.model_inputs(config, max_seq_len=32, padding='left')."
    )


def _with_new_tokens(
    prompts: SearchStrategy[dict[str, torch.Tensor]], max_new_tokens: int
) -> DrawnBytes[tuple[dict[str, torch.Tensor], int]]:
    """A prompt batch and how many tokens to decode from it, drawn as one byte string.

    The prompt's bytes (``model_inputs``'), then one byte for the count: drawn as bytes, as
    ``check_equivalent``'s inputs are, the group shrinks to the smallest prompt (one padded row of
    two tokens for a mask dropped on single-token steps), where a tuple of the prompt and an
    integer, in a list, stopped at longer ones.
    """
    drawn = drawn_bytes(prompts)
    assert drawn is not None  # model_inputs with listed sizes, as built above
    size = drawn.size + 1

    def build(raw: bytes) -> tuple[dict[str, torch.Tensor], int]:
        return drawn.build(raw[:-1]), 1 + (raw[-1] * max_new_tokens >> 8)

    return DrawnBytes(st.binary(min_size=size, max_size=size), build, size)
