"""Lossless weight round-trips: load a checkpoint with the registered patches, save it, compare.

A patch that changes a weight layout (fused QKV, module-list experts, fused patch
embeddings) is only safe to ship if ``from_pretrained`` -> ``save_pretrained``
gives the checkpoint back bit for bit. ``assert_roundtrip`` proves that with the
patches and conversions currently registered in transformers (the test's), and
then reloads the saved copy *without* patches to show the reference outputs are
unchanged.

Example::

    report = assert_roundtrip(checkpoint_dir, tmp_path=tmp_path)
    print(report)  # roundtrip passed: 48/48 tensors identical, 2.1 MB compared; outputs identical
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import transformers

from pytest_modelpatch.compare._engine.devices import unwrapped
from pytest_modelpatch.compare._engine.reports import conclude
from pytest_modelpatch.families.inputs import example_inputs
from pytest_modelpatch.isolation.guard import builtin_patch_state, isolated_patch_state
from pytest_modelpatch.models.builder import LoadChoices
from pytest_modelpatch.models.checkpoints import checkpoint_model_class, load_pretrained, validate_checkpoint_dir
from pytest_modelpatch.reporting.records import CheckRecord
from pytest_modelpatch.roundtrip.differences import OutputDiff, config_changes, identical_outputs, output_leaves
from pytest_modelpatch.roundtrip.safetensors_diff import CheckpointDiff, diff_checkpoints, open_checkpoint


@dataclass
class RoundtripReport:
    """What one round-trip compared and how it went; ``passed`` is the verdict."""

    source: Path
    saved: Path
    model_class: str
    dtype: str
    save_original_format: bool
    weights: CheckpointDiff
    outputs: list[OutputDiff] = field(default_factory=list)
    outputs_checked: bool = False
    outputs_implied: bool = False  # identical tensors and config.json: the reload is the source model
    config_changes: list[str] = field(default_factory=list)
    duration_s: float = 0.0

    @property
    def outputs_identical(self) -> bool:
        return all(row.identical for row in self.outputs)

    @property
    def passed(self) -> bool:
        return self.weights.identical and self.outputs_identical

    def summary(self) -> str:
        if not self.outputs_checked:
            outputs = "outputs not checked"
        elif self.outputs_implied:
            outputs = "outputs unchanged (implied: identical tensors and config)"
        elif self.outputs_identical:
            outputs = "outputs identical"
        else:
            outputs = f"outputs differ (max abs diff {max(row.max_abs_diff for row in self.outputs):.3g})"
        verdict = "passed" if self.passed else "FAILED"
        return f"roundtrip {verdict}: {self.weights.summary()}; {outputs}"

    def __str__(self) -> str:
        layout = "original layout" if self.save_original_format else "patched layout (save_original_format=False)"
        lines = [
            self.summary(),
            f"  {self.model_class} [{self.dtype}], {layout}, {self.duration_s:.2f}s",
            f"  source: {self.source}",
            f"  saved:  {self.saved}",
        ]
        lines += str(self.weights).splitlines()[1:]
        lines += [f"  output {row}" for row in self.outputs if not row.identical]
        lines += [f"  note: config.json {line}" for line in self.config_changes]
        return "\n".join(lines)


def assert_roundtrip(
    source: str | Path | transformers.PreTrainedModel,
    *,
    tmp_path: str | Path | None = None,
    save_original_format: bool = True,
    model_class: type[transformers.PreTrainedModel] | None = None,
    dtype: torch.dtype | str | None = None,
    inputs: Mapping[str, torch.Tensor] | None = None,
    fusion_config: Mapping[str, Any] | None = None,
    max_shard_size: int | str | None = None,
    check_outputs: bool = True,
    load_kwargs: Mapping[str, Any] | None = None,
    transforms: Sequence[Callable[[Any], Any]] = (),
) -> RoundtripReport:
    """Load ``source`` with the registered patches, save it, and demand the same checkpoint back.

    ``source`` is a checkpoint directory or a reference (unpatched) model, which is
    saved first. Raises AssertionError with the report when a tensor, a safetensors
    header or a reference output differs; returns the report otherwise.
    ``load_kwargs`` (``from_pretrained`` keywords) and ``transforms`` (``fn(model)`` returning a
    model or None) shape each patched load as the patch marker shapes ``patched_model``; the
    ``roundtrip`` fixture passes the test's. A wrapper (PEFT's ``PeftModel``) saves its base model.

    Example::

        register_patch_mapping(MAPPING)
        register_checkpoint_conversion_mapping("llama", CONVERSIONS["llama"], overwrite=True)
        assert_roundtrip(checkpoint_dir, tmp_path=tmp_path)
    """
    __tracebackhide__ = True
    started = time.perf_counter()
    with _work_dir(tmp_path) as work:
        report = _run_roundtrip(
            source,
            work,
            save_original_format=save_original_format,
            model_class=model_class,
            dtype=dtype,
            inputs=inputs,
            fusion_config=dict(fusion_config) if fusion_config else None,
            max_shard_size=max_shard_size,
            check_outputs=check_outputs,
            choices=LoadChoices(dict(load_kwargs or {}), tuple(transforms)),
        )
    report.duration_s = time.perf_counter() - started
    return conclude(report, _record(report))


class Roundtrip:
    """The ``roundtrip`` fixture: ``assert_roundtrip`` bound to the test's ``tmp_path``.

    Example::

        def test_fused_qkv_saves_original_layout(roundtrip, llama_checkpoint):
            roundtrip.check(llama_checkpoint)
    """

    def __init__(self, tmp_path: str | Path, choices: LoadChoices | None = None) -> None:
        self.tmp_path = Path(tmp_path)
        self.choices = choices  # the patch marks' load keywords and transforms, for every patched load

    def check(self, source: str | Path | transformers.PreTrainedModel, **options: Any) -> RoundtripReport:
        """Run ``assert_roundtrip(source, tmp_path=<the test's tmp_path>, **options)`` with the test's load choices."""
        __tracebackhide__ = True
        if self.choices is not None:
            options.setdefault("load_kwargs", self.choices.kwargs)
            options.setdefault("transforms", self.choices.transforms)
        return assert_roundtrip(source, tmp_path=self.tmp_path, **options)


def load_with_fusion(
    source: str | Path,
    fusion_config: Mapping[str, Any],
    *,
    model_class: type[transformers.PreTrainedModel] | None = None,
    dtype: torch.dtype | str | None = None,
) -> transformers.PreTrainedModel:
    """``from_pretrained(source, fusion_config=...)`` without leaking the fusion's global patches.

    transformers registers a fusion as global patch mappings and conversions; they
    are undone on return, while the model keeps its fused modules and the
    conversions it needs to save in the original layout. Loaded as the fixtures load
    (``models.checkpoints.load_pretrained``), in the checkpoint's dtype unless ``dtype=``.

    Example::

        model = load_with_fusion(qwen2_vl_dir, {"patch_embeddings": True})
    """
    path = Path(source)
    return _load(model_class or _model_class(path), path, dtype or "auto", dict(fusion_config))


# ---------------------------------------------------------------------------
# The steps
# ---------------------------------------------------------------------------


def _run_roundtrip(
    source: str | Path | transformers.PreTrainedModel,
    work: Path,
    *,
    save_original_format: bool,
    model_class: type[transformers.PreTrainedModel] | None,
    dtype: torch.dtype | str | None,
    inputs: Mapping[str, torch.Tensor] | None,
    fusion_config: dict[str, Any] | None,
    max_shard_size: int | str | None,
    check_outputs: bool,
    choices: LoadChoices,
) -> RoundtripReport:
    # One model in memory at a time; each is dropped (by refcount) before the next load.
    # Unpatched steps share one builtin_patch_state() block: entering it costs a rebuild of
    # transformers' conversion table.
    reference_outputs: dict[str, Any] | None = None
    if isinstance(source, transformers.PreTrainedModel):
        cls = model_class or type(source)
        source_dir = work / "source"
        with builtin_patch_state():
            source.save_pretrained(source_dir)
        if check_outputs and save_original_format:
            inputs = inputs if inputs is not None else example_inputs(source.config, model_class=cls)
            reference_outputs = output_leaves(source, inputs)
    else:
        source_dir = Path(source)
        open_checkpoint(source_dir)  # bad input fails here, naming the file, before any model is built
        cls = model_class or _model_class(source_dir)
    load_dtype = dtype or "auto"
    save_kwargs: dict[str, Any] = {"save_original_format": save_original_format}
    if max_shard_size is not None:
        save_kwargs["max_shard_size"] = max_shard_size

    saved_dir = work / "saved"
    patched = _load_patched(cls, source_dir, load_dtype, fusion_config, choices)
    resolved_dtype = str(patched.dtype).removeprefix("torch.")
    if check_outputs and not save_original_format:
        # The patched layout cannot load without patches: the reference is the patched model itself.
        inputs = inputs if inputs is not None else example_inputs(patched.config, model_class=cls)
        reference_outputs = output_leaves(patched, inputs)
    patched.save_pretrained(saved_dir, **save_kwargs)
    del patched

    outputs: list[OutputDiff] = []
    weights: CheckpointDiff | None = None
    changes: list[str] = []
    outputs_implied = False
    if save_original_format:
        compared_from, compared_to = source_dir, saved_dir
        weights, changes = diff_checkpoints(source_dir, saved_dir), config_changes(source_dir, saved_dir)
        # Same tensors, same config.json, same modeling code: reloading the saved copy
        # without patches builds the source model again, so its outputs cannot differ.
        # Reload and run it only when something did change, to show what that costs.
        outputs_implied = check_outputs and weights.identical and not changes and reference_outputs is None
        if check_outputs and not outputs_implied:
            with builtin_patch_state():
                if reference_outputs is None:
                    reference = _load(cls, source_dir, load_dtype, fusion_config={})
                    inputs = inputs if inputs is not None else example_inputs(reference.config, model_class=cls)
                    reference_outputs = output_leaves(reference, inputs)
                    del reference
                reloaded = _load(cls, saved_dir, load_dtype, fusion_config={})
                outputs = identical_outputs(reference_outputs, output_leaves(reloaded, inputs or {}))
                del reloaded
    else:
        # save -> reload with patches -> save again must give the patched layout back
        compared_from, compared_to = saved_dir, work / "resaved"
        reloaded = _load_patched(cls, saved_dir, load_dtype, fusion_config, choices)
        if reference_outputs is not None:
            outputs = identical_outputs(reference_outputs, output_leaves(reloaded, inputs or {}))
        reloaded.save_pretrained(compared_to, **save_kwargs)
        del reloaded

    return RoundtripReport(
        source=source_dir,
        saved=compared_to,
        model_class=cls.__name__,
        dtype=resolved_dtype,
        save_original_format=save_original_format,
        weights=weights or diff_checkpoints(compared_from, compared_to),
        outputs=outputs,
        outputs_checked=reference_outputs is not None or outputs_implied,
        outputs_implied=outputs_implied,
        config_changes=changes or config_changes(compared_from, compared_to),
    )


def _model_class(checkpoint: Path) -> type[transformers.PreTrainedModel]:
    """The class the fixtures would load ``checkpoint`` as; a bad ``config.json`` is a ``CheckpointError``."""
    validate_checkpoint_dir(checkpoint)
    return checkpoint_model_class(checkpoint)


def _load(
    cls: type[transformers.PreTrainedModel],
    path: Path,
    dtype: torch.dtype | str,
    fusion_config: dict[str, Any] | None,
    **load_kwargs: Any,
) -> transformers.PreTrainedModel:
    # The fixtures' loader: through the Auto class, and a weight the checkpoint lacks (a patch
    # that drops or renames one) filled from a fixed seed, so a round-trip load of a patched
    # model gives what the patched_model fixture gives, whatever the test's random state.
    if fusion_config is None:
        return load_pretrained(path, dtype=dtype, model_class=cls, **load_kwargs)
    # A fusion registers global patches and conversions while loading; keep them from leaking.
    # An empty fusion_config overrides one stored in config.json (transformers reuses that).
    with isolated_patch_state():
        return load_pretrained(path, dtype=dtype, model_class=cls, fusion_config=fusion_config, **load_kwargs)


def _load_patched(
    cls: type[transformers.PreTrainedModel],
    path: Path,
    dtype: torch.dtype | str,
    fusion_config: dict[str, Any] | None,
    choices: LoadChoices,
) -> transformers.PreTrainedModel:
    """A patched load as ``patched_model``'s: the load keywords, then the transforms; a wrapper's base model."""
    model = _load(cls, path, dtype, fusion_config, **choices.kwargs)
    return unwrapped(choices.transform(model))


@contextmanager
def _work_dir(tmp_path: str | Path | None) -> Iterator[Path]:
    if tmp_path is None:
        with tempfile.TemporaryDirectory(prefix="modelpatch-roundtrip-") as work:
            yield Path(work)
    else:
        Path(tmp_path).mkdir(parents=True, exist_ok=True)
        yield Path(tempfile.mkdtemp(prefix="roundtrip-", dir=tmp_path))


def _record(report: RoundtripReport) -> CheckRecord:
    """The report row: byte-level figures, not a tolerance's (a round-trip must give the same bytes back)."""
    from transformers import monkey_patching

    mapping = dict(monkey_patching.get_patch_mapping())
    diffs = [row.max_abs_diff for row in report.outputs] + [report.weights.max_abs_diff or 0.0]
    return CheckRecord(
        kind="roundtrip",
        outcome="passed" if report.passed else "failed",
        model=report.model_class,
        patch_keys=sorted(mapping),
        replacements=sorted(f"{c.__module__}.{c.__qualname__}" for c in mapping.values()),
        device="cpu",
        dtype=report.dtype,
        max_abs_error=max(diffs),
        elements_over_tolerance=sum(row.differing_elements for row in report.weights.tensors),
        elements_compared=sum(row.elements for row in report.weights.tensors),
        duration_s=report.duration_s,
        detail=report.summary(),
    )
