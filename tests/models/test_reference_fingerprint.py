"""ReferenceRecord.problems() skips the full check when nothing it reads changed, and says what full_problems() says."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from fixtures import load_patch
from pytest_modelpatch.errors import ReferenceNotPristineError
from pytest_modelpatch.families.inputs import example_inputs
from pytest_modelpatch.models.builder import ModelBuilder, ModelRequest
from pytest_modelpatch.models.reference import _RECORD


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> torch.nn.Module:
    return ModelBuilder(tmp_path_factory.mktemp("checkpoints")).reference(ModelRequest("llama"))


def _rebind_mlp_forward(model: torch.nn.Module) -> Callable[[], None]:
    cls = type(model.model.layers[0].mlp)
    original = cls.__dict__["forward"]
    cls.forward = lambda self, x: original(self, x) * 2
    return lambda: setattr(cls, "forward", original)


def _add_method(model: torch.nn.Module) -> Callable[[], None]:
    cls = type(model.model.layers[0].self_attn)
    cls.extra_kernel = lambda self: None
    return lambda: delattr(cls, "extra_kernel")


def _swap_submodule(model: torch.nn.Module) -> Callable[[], None]:
    layer = model.model.layers[0]
    original = layer.mlp
    replacement = load_patch("llama_swiglu_autograd_broken").MAPPING["LlamaMLP"](model.config)
    layer.mlp = replacement
    return lambda: setattr(layer, "mlp", original)


def _reclass_module(model: torch.nn.Module) -> Callable[[], None]:
    norm = model.model.norm
    original = type(norm)
    norm.__class__ = type("FusedNorm", (original,), {})
    return lambda: setattr(norm, "__class__", original)


def _drop_capture_hooks(model: torch.nn.Module) -> Callable[[], None]:
    record = getattr(model, _RECORD)
    name = next(name for name in record.hooks if name)
    module = model.get_submodule(name)
    saved = dict(module._forward_hooks)
    module._forward_hooks.clear()
    return lambda: module._forward_hooks.update(saved)


def _replace_hook_table(model: torch.nn.Module) -> Callable[[], None]:
    record = getattr(model, _RECORD)
    module = model.get_submodule(next(name for name in record.hooks if name))
    saved = module._forward_hooks
    module._forward_hooks = type(saved)()
    return lambda: setattr(module, "_forward_hooks", saved)


@pytest.mark.parametrize(
    "change",
    [_rebind_mlp_forward, _add_method, _swap_submodule, _reclass_module, _drop_capture_hooks, _replace_hook_table],
)
def test_the_fast_check_reports_what_the_full_check_reports_after_a_change(
    reference: torch.nn.Module, change: Callable[[torch.nn.Module], Callable[[], None]]
) -> None:
    record: Any = getattr(reference, _RECORD)
    assert record.problems(reference) == [] == record.full_problems(reference)
    assert reference in record._clean and record._clean[reference].holds(reference)  # the next call takes the fast path
    undo = change(reference)
    try:
        found = record.problems(reference)
        assert found and found == record.full_problems(reference)
        with pytest.raises(ReferenceNotPristineError):
            reference(input_ids=torch.ones(1, 3, dtype=torch.long))
    finally:
        undo()
    assert record.problems(reference) == [] == record.full_problems(reference)


def test_a_fingerprint_does_not_keep_a_released_model_alive(tmp_path: Path) -> None:
    import gc
    import weakref

    model = ModelBuilder(tmp_path).reference(ModelRequest("llama", seed=3))
    record: Any = getattr(model, _RECORD)
    record.problems(model)
    gone = weakref.ref(model)
    del model
    gc.collect()
    assert gone() is None and len(record._clean) == 0


@pytest.fixture(scope="module")
def big_bird(tmp_path_factory: pytest.TempPathFactory) -> tuple[torch.nn.Module, torch.nn.Module]:
    builder = ModelBuilder(tmp_path_factory.mktemp("big_bird"))
    return builder.reference(ModelRequest("big_bird")), builder.patched(ModelRequest("big_bird"), unpatched=True)


def test_a_reference_that_rewires_itself_stays_callable_and_unpatched(big_bird: Any) -> None:
    # BigBird swaps its block-sparse attention for full attention on inputs shorter than its
    # blocks, inside its forward: the reference's own doing, not a patch
    reference, patched = big_bird
    inputs = example_inputs(reference.config, model_class=type(reference))
    with torch.no_grad():
        first = reference(**inputs).logits
        again = reference(**inputs).logits
        expected = patched(**inputs).logits
    attention = reference.bert.encoder.layer[0].attention.self
    assert type(attention).__name__ == "BigBirdSelfAttention"
    assert torch.equal(first, again) and torch.equal(again, expected)


def test_after_its_own_rewiring_a_reference_still_refuses_a_swapped_module(big_bird: Any) -> None:
    reference, _ = big_bird
    inputs = example_inputs(reference.config, model_class=type(reference))
    with torch.no_grad():
        reference(**inputs)  # rewired, and adopted
    attention = reference.bert.encoder.layer[0].attention
    original = attention.self
    # a subclass from outside the modeling file, as a kernel library would bind it
    attention.self = type("FastSelfAttention", (type(original),), {})(reference.config, layer_idx=0)
    try:
        with pytest.raises(ReferenceNotPristineError, match="FastSelfAttention"), torch.no_grad():
            reference(**inputs)
    finally:
        attention.self = original
