"""Decoding equivalence: greedy decoding of both models, step by step, through their KV caches.

Attention, rotary and cache patches often agree on a full-sequence forward and break in
incremental decoding: a cache update that is stored but not attended to, a mask dropped
when ``q_len == 1``, a static-cache position off by one, a sliding window applied to the
prefill only. ``assert_decodes_equivalent`` runs the decoding loop itself (prefill, then
one token per step with the cache, position ids and an attention mask extended by one),
the same loop for both models, so step ``k`` of one is comparable with step ``k`` of the
other, and compares each step's logits and chosen tokens.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from pytest_modelpatch.compare._engine.devices import evaluating, model_device, move_inputs, placement, unwrapped
from pytest_modelpatch.compare._engine.divergence import Divergence, find_divergence
from pytest_modelpatch.compare._engine.hints import cache_keyword, implementations_line, unfilled_cache_hint
from pytest_modelpatch.compare._engine.inputs import describe_inputs
from pytest_modelpatch.compare._engine.outputs import TensorComparison, compare_tensors, describe_tolerances
from pytest_modelpatch.compare._engine.reports import CheckReport, given_inputs
from pytest_modelpatch.compare._engine.same_model import require_same_model
from pytest_modelpatch.compare._engine.tolerance import TolerancePolicy, ToleranceSpec, resolve_tolerance
from pytest_modelpatch.errors import PatchUsageError
from pytest_modelpatch.isolation.pristine import pristine
from pytest_modelpatch.models.usage import unused_message, unused_replacements

# transformers 5.x cache_implementation names this loop builds; None is generate()'s default.
CACHE_IMPLEMENTATIONS: tuple[str | None, ...] = (None, "dynamic", "static")


# ---------------------------------------------------------------------------
# Prompts and caches
# ---------------------------------------------------------------------------


def default_prompts(model: torch.nn.Module, *, batch_size: int = 3, seq_len: int = 8) -> dict[str, torch.Tensor]:
    """A left-padded batch with unequal prompt lengths (``seq_len``, ``seq_len - 3``, ...) and its mask.

    Rows after the first are padded on the left, as ``generate`` wants for decoder-only
    models, so a patch that ignores the attention mask on single-token steps sees padding.

    Example: ``default_prompts(model)["attention_mask"]`` -> ``[[1]*8, [0,0,0,1,1,1,1,1], [0]*6 + [1,1]]``.
    """
    inputs = dict(default_inputs_for(model, batch_size, seq_len))
    mask = inputs["attention_mask"].clone()
    for row in range(1, batch_size):
        mask[row, : min(3 * row, seq_len - 1)] = 0  # each row keeps at least one real token
    config: Any = model.config  # a transformers config: torch reads a module's attributes as Tensor | Module
    pad = getattr(config.get_text_config(), "pad_token_id", None)
    if isinstance(pad, int) and 0 <= pad:
        inputs["input_ids"] = inputs["input_ids"].masked_fill(mask == 0, pad)
    inputs["attention_mask"] = mask
    return inputs


def default_inputs_for(model: torch.nn.Module, batch_size: int, seq_len: int) -> dict[str, torch.Tensor]:
    from pytest_modelpatch.families.inputs import example_inputs

    return example_inputs(model.config, batch_size=batch_size, seq_len=seq_len, device=str(model_device(model)))


def validate_cache_implementation(cache_implementation: str | None) -> None:
    """Refuse a ``cache_implementation`` this check cannot build, naming the ones it can."""
    if cache_implementation not in CACHE_IMPLEMENTATIONS:
        raise PatchUsageError(
            f"assert_decodes_equivalent: cache_implementation={cache_implementation!r} is not supported; use None "
            "(the dynamic cache, sliding-window layers included where the config has them) or 'static'."
        )


def new_cache(model: torch.nn.Module, cache_implementation: str | None, max_cache_len: int) -> Any:
    """The cache ``generate`` would build: per-layer types (full, sliding) come from the config."""
    from transformers import DynamicCache, StaticCache

    if cache_implementation == "static":
        return StaticCache(config=model.config, max_cache_len=max_cache_len)
    return DynamicCache(config=model.config)


# ---------------------------------------------------------------------------
# The loop
# ---------------------------------------------------------------------------


@dataclass
class DecodeStep:
    """One step compared: its logits (the prefill's at real positions) and the tokens each model chose."""

    step: int  # 0: the prefill, k: the k-th single-token step
    logits: TensorComparison
    reference_tokens: list[int]
    patched_tokens: list[int]
    near_ties: list[int] = field(default_factory=list)  # rows whose tokens differ at a near-tie
    mismatches: list[int] = field(default_factory=list)  # rows whose tokens differ beyond one
    gaps: dict[int, float] = field(default_factory=dict)  # row -> reference logit gap at a differing token

    @property
    def passed(self) -> bool:
        return self.logits.passed and not self.mismatches

    @property
    def name(self) -> str:
        return "prefill" if self.step == 0 else f"step {self.step}"


class PairDecoder:
    """Both models' caches, mask and positions, advanced together one token at a time."""

    def __init__(
        self, reference: torch.nn.Module, patched: torch.nn.Module, prompts: Mapping[str, Any], max_cache_len: int,
        cache_implementation: str | None,
    ) -> None:  # fmt: skip
        self.reference, self.patched = reference, patched
        device = model_device(reference)
        self.prompts = move_inputs(prompts, device)
        ids = self.prompts["input_ids"]
        mask = self.prompts.get("attention_mask")
        self.mask = torch.ones_like(ids) if mask is None else mask
        # generate()'s positions for a padded batch: attended tokens only, padded slots 0.
        positions = self.prompts.get("position_ids")
        if positions is None:
            positions = (self.mask.long().cumsum(-1) - 1).masked_fill(self.mask == 0, 0)
        self.positions: torch.Tensor = positions
        with pristine():  # the reference's cache is built in the unpatched world too
            self.reference_cache = new_cache(reference, cache_implementation, max_cache_len)
        self.patched_cache = new_cache(unwrapped(patched), cache_implementation, max_cache_len)

    def step_inputs(self, tokens: torch.Tensor | None) -> tuple[dict[str, Any], dict[str, Any]]:
        """The reference's and the patched model's inputs for the next forward (the prompt when ``tokens`` is None)."""
        if tokens is None:
            shared = {**self.prompts, "attention_mask": self.mask, "position_ids": self.positions, "use_cache": True}
        else:
            self.mask = torch.cat([self.mask, self.mask.new_ones(self.mask.shape[0], 1)], dim=-1)
            self.positions = self.positions[:, -1:] + 1
            shared = {"input_ids": tokens[:, None], "attention_mask": self.mask, "position_ids": self.positions,
                      "use_cache": True}  # fmt: skip
        return (
            {**shared, cache_keyword(self.reference): self.reference_cache},
            {**shared, cache_keyword(self.patched): self.patched_cache},
        )

    def cache_hint(self) -> str:
        """A hint when the patched cache is still empty and the reference's is not (a forward skipped the update)."""
        if self.patched_cache.get_seq_length() == 0 < self.reference_cache.get_seq_length():
            return unfilled_cache_hint(self.patched, "after the prefill")
        return ""

    def run(self, tokens: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """One forward of both models; their logits."""
        ref_inputs, pat_inputs = self.step_inputs(tokens)
        return self.reference(**ref_inputs).logits, self.patched(**pat_inputs).logits


def _bound(tolerance: Any, value: float, amax: float) -> float:
    return tolerance.abs_term(amax) + tolerance.rtol * abs(value)


def judge_step(
    step: int, reference: torch.Tensor, patched: torch.Tensor, mask: torch.Tensor | None, spec: ToleranceSpec
) -> DecodeStep:
    """Compare one step's logits and greedy tokens; a differing token at a near-tie is not a mismatch.

    A near-tie: the reference's logit gap between its token and the patched model's token is
    within the tolerance the logits are judged by (the sum of both elements' bounds), so logits
    that agree within tolerance may legitimately pick either.
    """
    if mask is not None:  # the prefill: padded positions compute nothing anyone reads
        keep = mask.bool()[..., None]
        compared = compare_tensors("prefill logits", reference.where(keep, 0), patched.where(keep, 0), spec)
    else:
        compared = compare_tensors(f"step {step} logits", reference, patched, spec)
    last_ref, last_pat = reference[:, -1].float(), patched[:, -1].float()
    ref_tokens, pat_tokens = last_ref.argmax(-1), last_pat.argmax(-1)
    result = DecodeStep(step, compared, ref_tokens.tolist(), pat_tokens.tolist())
    tolerance = spec.for_dtype(reference.dtype)
    for row in (ref_tokens != pat_tokens).nonzero().flatten().tolist():
        ours, theirs = float(last_ref[row, ref_tokens[row]]), float(last_ref[row, pat_tokens[row]])
        finite = last_ref[row][last_ref[row].isfinite()].abs()
        amax = float(finite.max()) if finite.numel() else 0.0
        result.gaps[row] = ours - theirs
        allowed = _bound(tolerance, ours, amax) + _bound(tolerance, theirs, amax)
        (result.near_ties if ours - theirs <= allowed else result.mismatches).append(row)
    return result


def decode_pair(
    reference: torch.nn.Module, patched: torch.nn.Module, prompts: Mapping[str, Any], *, max_new_tokens: int,
    cache_implementation: str | None, spec: ToleranceSpec,
) -> tuple[list[DecodeStep], str]:  # fmt: skip
    """Greedy decoding of both, teacher-forced on the reference's tokens; stops after the first failing step.

    Returns the steps and, when a step failed with the patched cache still empty, a hint why.
    """
    length = prompts["input_ids"].shape[-1]
    decoder = PairDecoder(reference, patched, prompts, length + max_new_tokens, cache_implementation)
    steps: list[DecodeStep] = []
    tokens: torch.Tensor | None = None
    with evaluating(reference, patched):
        for step in range(max_new_tokens):
            mask = decoder.mask if tokens is None else None
            ref_logits, pat_logits = decoder.run(tokens)
            steps.append(judge_step(step, ref_logits, pat_logits, mask, spec))
            if not steps[-1].passed:
                return steps, decoder.cache_hint()
            tokens = ref_logits[:, -1].argmax(-1)
    return steps, ""


def locate_step(
    reference: torch.nn.Module, patched: torch.nn.Module, prompts: Mapping[str, Any], steps: list[DecodeStep], *,
    max_new_tokens: int, cache_implementation: str | None, spec: ToleranceSpec,
) -> Divergence | None:  # fmt: skip
    """The first diverging module at the last step: replay the steps before it, then record that one."""
    length = prompts["input_ids"].shape[-1]
    decoder = PairDecoder(reference, patched, prompts, length + max_new_tokens, cache_implementation)
    device = model_device(reference)
    tokens: torch.Tensor | None = None
    with evaluating(reference, patched):
        for done in steps[:-1]:
            decoder.run(tokens)
            tokens = torch.tensor(done.reference_tokens, device=device)
        ref_inputs, pat_inputs = decoder.step_inputs(tokens)
        return find_divergence(reference, patched, ref_inputs, spec, patched_inputs=pat_inputs)


# ---------------------------------------------------------------------------
# The check
# ---------------------------------------------------------------------------


@dataclass
class DecodingReport(CheckReport):
    """The outcome of greedy decoding both models from the same prompts, step by step."""

    check_kind = "decode"

    reference: str
    patched: str
    steps: list[DecodeStep]
    tolerance: ToleranceSpec
    max_new_tokens: int
    cache_implementation: str | None = None
    inputs: str = ""
    device: str = ""
    dtype: str = ""
    divergence: Divergence | None = None
    duration_s: float = 0.0
    hint: str = ""  # why it failed, when that can be told (a patched cache left empty)
    unused: str = ""  # why the check proves nothing about some replacement, when one never ran

    @property
    def passed(self) -> bool:
        return all(s.passed for s in self.steps) and not self.unused

    @property
    def failed_step(self) -> DecodeStep | None:
        return next((s for s in self.steps if not s.passed), None)

    @property
    def near_ties(self) -> int:
        """Token choices that differed at a near-tie (decoding went on with the reference's token)."""
        return sum(len(s.near_ties) for s in self.steps)

    @property
    def worst_step(self) -> DecodeStep | None:
        return max(self.steps, key=lambda s: s.logits.max_abs, default=None)

    @property
    def comparisons(self) -> list[TensorComparison]:
        """Every step's logits compared (the row's figures)."""
        return [s.logits for s in self.steps]

    @property
    def cache(self) -> str:
        return (
            "dynamic cache" if self.cache_implementation in (None, "dynamic") else f"{self.cache_implementation} cache"
        )

    def __str__(self) -> str:
        where = f" ({self.dtype} on {self.device}, {self.cache})"
        ties = f"; {self.near_ties} near-tie token(s) taken from the reference" if self.near_ties else ""
        failed = self.failed_step
        if failed is None and self.unused:
            return "\n".join([
                f"patched {self.patched} decodes like reference {self.reference}{where}, but proves nothing about "
                "a replacement:", self.unused, f"inputs: {self.inputs}",
            ])  # fmt: skip
        if failed is None:
            worst = self.worst_step
            return (
                f"patched {self.patched} decodes like reference {self.reference}{where}: prefill and "
                f"{len(self.steps) - 1} step(s), max abs {self.max_abs_error:.3g} (worst: {worst.name if worst else '-'})"
                f"{ties}\ntolerance: {self.tolerance}"
            )
        lines = [
            f"patched {self.patched} decodes differently from reference {self.reference}{where}: "
            f"first diverging step: {failed.name} (of {self.max_new_tokens} new tokens), batch row {self._row(failed)}",
            *([self.hint] if self.hint else []),
            *([self.unused] if self.unused else []),
            f"inputs: {self.inputs}",
            *describe_tolerances([failed.logits]),
            f"  {failed.logits}",
            *self._token_lines(failed),
        ]
        if ties:
            lines.append(f"near-ties so far (tokens taken from the reference): {self.near_ties}")
        if self.divergence is not None:
            lines.append(self.divergence.text(f"at {failed.name}, "))
        so_far = [list(row) for row in zip(*(s.reference_tokens for s in self.steps[:-1]))]
        lines.append(f"tokens before it, per row (the reference's, fed to both): {so_far}")
        return "\n".join(lines)

    @staticmethod
    def _row(step: DecodeStep) -> int:
        if step.mismatches:
            return step.mismatches[0]
        index = step.logits.worst_index
        return index[0] if index else 0

    @staticmethod
    def _token_lines(step: DecodeStep) -> list[str]:
        lines = []
        for row in step.mismatches[:3]:
            lines.append(
                f"  row {row}: reference token {step.reference_tokens[row]}, patched token {step.patched_tokens[row]} "
                f"(reference logit gap {step.gaps[row]:.4g}, beyond the tolerance: not a near-tie)"
            )
        if not step.mismatches:
            lines.append(f"  tokens: reference {step.reference_tokens}, patched {step.patched_tokens}")
        return lines

    def judged_comparison(self) -> TensorComparison | None:
        """The row shows the failing step's logits, else the worst step's."""
        shown = self.failed_step or self.worst_step
        return shown.logits if shown is not None else None

    def worst_output(self) -> str:
        judged = self.judged_comparison()
        return judged.path if judged is not None else ""


def compare_decoding(
    reference: torch.nn.Module, patched: torch.nn.Module, prompts: Mapping[str, Any], spec: ToleranceSpec, *,
    max_new_tokens: int, cache_implementation: str | None, locate: bool = True,
) -> DecodingReport:  # fmt: skip
    """Decode both greedily from ``prompts`` and compare; on a failure, find the step's first diverging module."""
    start = time.perf_counter()
    steps, hint = decode_pair(
        reference, patched, prompts, max_new_tokens=max_new_tokens, cache_implementation=cache_implementation, spec=spec
    )
    hint = "\n".join(line for line in (implementations_line(reference, patched), hint) if line)
    report = DecodingReport(
        type(reference).__name__, type(patched).__name__, steps, spec, max_new_tokens, cache_implementation,
        inputs=describe_inputs(prompts), hint=hint, **placement(reference),
    )  # fmt: skip
    if locate and not report.passed:
        report.divergence = locate_step(
            reference,
            patched,
            prompts,
            steps,
            max_new_tokens=max_new_tokens,
            cache_implementation=cache_implementation,
            spec=spec,
        )
    report.duration_s = time.perf_counter() - start
    return report


def assert_decodes_equivalent(
    reference: torch.nn.Module,
    patched: torch.nn.Module,
    inputs: Mapping[str, Any] | torch.Tensor | None = None,
    *,
    max_new_tokens: int = 8,
    cache_implementation: str | None = None,
    atol: float | None = None,
    rtol: float | None = None,
    policy: str | TolerancePolicy | None = None,
    allow_unused: bool = False,
) -> DecodingReport:
    """Fail unless greedy decoding of ``patched`` matches ``reference`` step by step; returns the report.

    Both models decode from the same prompts (default: :func:`default_prompts`, a left-padded
    batch of unequal lengths) with their own cache (``None``: dynamic, ``"static"``). The prefill
    and every step's logits must agree within the tolerance and so must the chosen tokens,
    except at a near-tie, where decoding goes on with the reference's token. A replacement class of
    the patched model that never ran in the last step fails the check too, unless ``allow_unused=True``.

    Example::

        assert_decodes_equivalent(reference_model, patched_model)
        assert_decodes_equivalent(reference_model, patched_model, cache_implementation="static", max_new_tokens=16)
    """
    __tracebackhide__ = True
    require_same_model(reference, patched, "assert_decodes_equivalent")
    validate_cache_implementation(cache_implementation)
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise PatchUsageError(
            f"assert_decodes_equivalent: max_new_tokens={max_new_tokens!r}; pass a positive int, e.g. 8."
        )
    inputs = given_inputs(inputs, lambda: default_prompts(reference))
    spec = resolve_tolerance(atol, rtol, policy)
    report = compare_decoding(
        reference, patched, inputs, spec, max_new_tokens=max_new_tokens, cache_implementation=cache_implementation
    )
    unused = [u.replacement for u in unused_replacements(unwrapped(patched))]
    if unused and not allow_unused:
        report.unused = unused_message(unused, where="the last decoding step")
    return report.conclude()
