"""One training step of a model: its labels, a loss, one seeded forward and backward in train mode.

``training_run`` is the single forward+backward that the backward checks build on. It runs
inside :func:`~pytest_modelpatch.compare._engine.train_mode.training_state`, which puts back
every module's training flag, dropout probabilities, gradient checkpointing attributes and each
parameter's ``.grad`` after, so a session-shared reference model is left exactly as it was found.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Iterator, Mapping, MutableMapping
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch

from pytest_modelpatch.compare._engine.devices import model_device, unwrapped
from pytest_modelpatch.compare._engine.outputs import flatten_outputs
from pytest_modelpatch.compare._engine.precision import ieee_float32
from pytest_modelpatch.compare._engine.running import forward
from pytest_modelpatch.compare._engine.train_mode import data_parallel_inner, parameter_gradients, training_state
from pytest_modelpatch.errors import PatchUsageError
from pytest_modelpatch.isolation.pristine import running_pristine
from pytest_modelpatch.models.devices import seeded_generators

LossFn = Callable[[Any], torch.Tensor]
TRAINING_SEED = 0  # both models run under this seed, so any randomness left draws the same numbers

# ---------------------------------------------------------------------------
# Inputs and losses
# ---------------------------------------------------------------------------


def with_labels(model: torch.nn.Module, inputs: Mapping[str, Any]) -> dict[str, Any]:
    """``inputs`` plus ``labels`` when the model's forward takes them and none were given.

    Causal and masked LMs get the input ids (padding set to -100, which their losses ignore);
    sequence and token classifiers get seeded class ids below ``config.num_labels``.

    Example: ``model(**with_labels(model, {"input_ids": ids}))["loss"]``.
    """
    from pytest_modelpatch.families.inputs import forward_parameters

    found = dict(inputs)
    ids = found.get("input_ids")
    # a wrapper's forward (PEFT's PeftModel) takes **kwargs: the model inside it says what they reach
    model = unwrapped(model)
    # the unpatched class's signature decides: a fused-loss forward(self, *args, **kwargs) must still get labels
    with running_pristine():
        takes_labels = "labels" in forward_parameters(type(model))
    if "labels" in found or not isinstance(ids, torch.Tensor) or not takes_labels:
        return found
    name = type(model).__name__
    generator = torch.Generator().manual_seed(TRAINING_SEED)
    classes = int(getattr(model.config, "num_labels", 2) or 2)
    if name.endswith("ForSequenceClassification"):
        found["labels"] = torch.randint(0, classes, (ids.shape[0],), generator=generator).to(ids.device)
    elif name.endswith("ForTokenClassification"):
        found["labels"] = torch.randint(0, classes, tuple(ids.shape), generator=generator).to(ids.device)
    else:
        labels = ids.clone()
        mask = found.get("attention_mask")
        if isinstance(mask, torch.Tensor) and mask.shape == labels.shape:
            labels = labels.masked_fill(mask == 0, -100)
        found["labels"] = labels
    return found


def has_loss_targets(model: torch.nn.Module, inputs: Mapping[str, Any]) -> bool:
    """Whether the model's own loss has a token to score: ``False`` when every label is ignored.

    A causal LM scores ``labels[:, 1:]`` (each token from the ones before it), so a one-token
    sequence, or padding that leaves one real token per row, has none: its loss is NaN (a mean
    over nothing) and its gradients zero, and comparing them would prove nothing.
    """
    labels = inputs.get("labels")
    if not isinstance(labels, torch.Tensor) or labels.is_floating_point() or labels.dim() < 2:
        return True  # class ids per sequence, or regression targets: always scored
    if type(unwrapped(model)).__name__.endswith("ForCausalLM"):
        labels = labels[..., 1:]
    return bool((labels != -100).any())


def default_reduction(outputs: Any) -> torch.Tensor:
    """The loss used when the model computes none: a fixed random projection of every output.

    ``sum over floating outputs o of (o * R_o).sum() / o.numel()``, ``R_o`` standard normal drawn
    from a generator seeded by the output's path, so both models get the same ``R`` and every
    output element gets its own non-zero gradient (a plain sum would give softmax outputs none).

    Example: ``default_reduction(model(**inputs)).backward()``.
    """
    total: torch.Tensor | None = None
    for path, leaf in flatten_outputs(outputs, caches=False):
        if not isinstance(leaf, torch.Tensor) or not leaf.is_floating_point() or not leaf.requires_grad:
            continue
        generator = torch.Generator().manual_seed(zlib.crc32(path.encode()))
        weight = torch.randn(tuple(leaf.shape), generator=generator, dtype=torch.float32).to(leaf.device)
        term = (leaf.float() * weight).sum() / max(leaf.numel(), 1)
        total = term if total is None else total + term
    if total is None:
        raise PatchUsageError(
            "assert_backward_equivalent: the model returned no floating output that requires grad, so there is "
            "nothing to backpropagate. Pass inputs the model differentiates, or loss=callable(outputs)."
        )
    return total


def training_loss(outputs: Any, loss: LossFn | None) -> tuple[torch.Tensor, str]:
    """The scalar to backpropagate and where it came from: ``loss=``, the model's loss, or the default."""
    if loss is not None:
        value, source = loss(outputs), f"loss={getattr(loss, '__name__', type(loss).__name__)}"
    elif isinstance(outputs, Mapping) and isinstance(outputs.get("loss"), torch.Tensor):
        value, source = outputs["loss"], "the model's loss"
    else:
        value, source = default_reduction(outputs), "default reduction (random projection of the outputs)"
    if not isinstance(value, torch.Tensor) or value.numel() != 1:
        raise PatchUsageError(
            f"assert_backward_equivalent: {source} gave {type(value).__name__}"
            f"{'' if not isinstance(value, torch.Tensor) else ' of shape ' + str(tuple(value.shape))}, not a scalar "
            "tensor. Reduce it, e.g. loss=lambda out: out.logits.float().pow(2).mean()."
        )
    return value.reshape(()), source


# ---------------------------------------------------------------------------
# One forward and backward
# ---------------------------------------------------------------------------


@dataclass
class TrainingRun:
    """What one training step computed: outputs, the loss, and every gradient by name."""

    outputs: Any
    loss: torch.Tensor
    loss_source: str
    gradients: dict[str, torch.Tensor | None]  # parameter name -> .grad (None: it got no gradient)
    input_gradients: dict[str, torch.Tensor] = field(default_factory=dict)  # "input_embeddings" -> grad


@contextmanager
def _input_embedding_gradients(model: torch.nn.Module, found: dict[str, torch.Tensor]) -> Iterator[None]:
    """Keep the gradient of every output of the model's input embeddings (one per call)."""
    getter = getattr(data_parallel_inner(model), "get_input_embeddings", None)
    try:
        embeddings = getter() if getter is not None else None
    except NotImplementedError:  # a model without text embeddings
        embeddings = None
    if not isinstance(embeddings, torch.nn.Module):
        yield
        return

    def keep(_: torch.nn.Module, args: Any, output: Any) -> Any:
        if not isinstance(output, torch.Tensor) or not output.is_floating_point():
            return None
        name = f"input_embeddings[{len(calls)}]" if calls else "input_embeddings"
        calls.append(name)
        if not output.requires_grad:  # frozen embeddings: the gradient still reaches this tensor
            output = output.detach().requires_grad_(True)
        output.register_hook(lambda grad: found.__setitem__(name, grad.detach()))
        return output

    calls: list[str] = []
    handle = embeddings.register_forward_hook(keep)
    try:
        yield
    finally:
        handle.remove()


def training_run(
    model: torch.nn.Module,
    inputs: Mapping[str, Any],
    *,
    loss: LossFn | None = None,
    checkpointing: Mapping[str, Any] | None = None,
    around_backward: Callable[[], AbstractContextManager[Any]] = nullcontext,
) -> TrainingRun:
    """One seeded forward and backward of ``model`` in :func:`training_state`; the model is left as found.

    ``around_backward``: a context for the backward (the reference runs it in ``running_pristine()``,
    so a checkpointed layer recomputed during backward is unpatched too).

    Example: ``training_run(model, with_labels(model, inputs)).gradients["lm_head.weight"]``.
    """
    device = model_device(model)
    input_grads: dict[str, torch.Tensor] = {}
    with ExitStack() as stack:
        stack.enter_context(seeded_generators(device, TRAINING_SEED))
        stack.enter_context(training_state(model, checkpointing))
        stack.enter_context(_input_embedding_gradients(model, input_grads))
        stack.enter_context(ieee_float32())  # the backward too
        with torch.enable_grad():
            outputs = forward(model, inputs)
            value, source = training_loss(outputs, loss)
            with around_backward():
                value.backward()
        gradients = parameter_gradients(model)
    return TrainingRun(_detached(outputs), value.detach(), source, gradients, input_grads)


def _detached(outputs: Any) -> Any:
    """Outputs without their autograd graph, so holding them keeps no activations alive."""
    if isinstance(outputs, MutableMapping):  # a ModelOutput, detached in place: it keeps its attributes
        for key, value in list(outputs.items()):
            if isinstance(value, torch.Tensor):
                outputs[key] = value.detach()
    elif isinstance(outputs, Mapping):  # read-only: a copy
        return {key: v.detach() if isinstance(v, torch.Tensor) else v for key, v in outputs.items()}
    return outputs
