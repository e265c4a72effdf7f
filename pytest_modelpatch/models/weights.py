"""Non-degenerate seeded weights for tiny checkpoints, so a patch that drops a weight or a bias is seen.

transformers' default init makes every norm weight 1 and every bias 0, and draws
matrices with std ``initializer_range`` (0.02): a norm that ignores its weight, or
a projection that drops its bias, computes the same numbers, and attention scores
are near zero. ``spread_weights`` redraws them, from its own seeded generator:

- a matrix, embedding, convolution kernel, router or expert stack (a trainable
  tensor with more than one dimension longer than 1): transformers' seeded random
  draw, rescaled to std ``1/sqrt(fan_in)``, so each projection keeps activations
  O(1) and attention scores are not flat;
- a tensor that transformers filled with one value ``c`` (norm weights, biases,
  layer scales, logit scales, zero-initialised gates): ``c + U(-0.5, 0.5) * s``
  with ``s = |c|``, or ``s = 0.5`` for ``c = 0``. Norm weights land in
  ``[0.5, 1.5]``, biases in ``[-0.25, 0.25]``;
- left alone: vectors and matrices transformers computed with structure (Mamba's
  ``A_log``, ``dt_bias``: anything not constant whose mean is beyond half its std), every buffer that is not a single value repeated (rotary
  ``inv_freq``, sinusoidal tables), non-persistent buffers (recomputed from the
  config and never saved), frozen parameters that are not constant, integer and
  boolean tensors, and anything that is not finite.

Example: ``spread_weights(model, seed=0)`` after building ``model`` from a config.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch

INIT_SCHEMES = ("modelpatch", "transformers")
DEFAULT_INIT = "modelpatch"
# bumped when the scheme changes, so cached checkpoints of an older scheme are rebuilt
INIT_VERSION = 1
CONSTANT_SPREAD = 0.5  # half-width of U(-0.5, 0.5) is scaled by |c|, or by this for c == 0
MAX_CONSTANT = 1e3  # fill values beyond this are masks or sentinels (-1e4, finfo.min): keep them


def spread_weights(model: torch.nn.Module, *, seed: int = 0) -> torch.nn.Module:
    """Redraw ``model``'s parameters and constant floating buffers in place; returns ``model``.

    Deterministic per ``seed`` and independent of the global RNG.
    Example: ``spread_weights(seeded_model(tiny_config("llama"), init="transformers"), seed=0)``.
    """
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module, tensor, learned in _floating_tensors(model):
            _spread(module, tensor, learned, generator)
    return model


def _floating_tensors(model: torch.nn.Module) -> Iterator[tuple[torch.nn.Module, torch.Tensor, bool]]:
    """(owning module, tensor, is a trainable parameter) once each: tied weights are visited once."""
    seen: set[int] = set()
    for module in model.modules():
        persistent = [
            (name, b) for name, b in module._buffers.items() if name not in module._non_persistent_buffers_set
        ]
        tensors: list[tuple[torch.Tensor, bool]] = [
            (p, p.requires_grad) for p in module._parameters.values() if p is not None
        ]
        tensors += [(b, False) for _, b in persistent if b is not None]
        for tensor, learned in tensors:
            if id(tensor) in seen or not tensor.is_floating_point() or tensor.numel() == 0:
                continue
            seen.add(id(tensor))
            yield module, tensor, learned


def _spread(module: torch.nn.Module, tensor: torch.Tensor, learned: bool, generator: torch.Generator) -> None:
    # one in-place draw per tensor: a tiny model has ~50 tensors, and per-op overhead is the cost here
    flat = tensor.detach().view(-1) if tensor.is_contiguous() else tensor.detach().reshape(-1)
    first = flat[0].item()
    if not math.isfinite(first):
        return
    if torch.equal(flat, flat[:1].expand_as(flat)):
        if abs(first) <= MAX_CONSTANT:
            half = (abs(first) if first != 0 else CONSTANT_SPREAD) / 2
            tensor.uniform_(first - half, first + half, generator=generator)
        return
    if learned and _is_matrix(tensor):
        std, mean = (float(v) for v in torch.std_mean(flat.float()))
        if abs(mean) > std / 2:  # not a zero-centred draw: computed structure such as Mamba's A_log
            return
        # transformers already drew it at random from the build's seed, only too small
        # (std 0.02): rescaling costs a reduction and a multiply, a fresh draw costs an RNG pass
        tensor.mul_((1.0 / math.sqrt(_fan_in(module, tensor))) / std)


def _is_matrix(tensor: torch.Tensor) -> bool:
    """More than one dimension longer than 1: a ``[1, 1, H]`` time-decay vector is not a matrix."""
    return sum(size > 1 for size in tensor.shape) > 1


def _fan_in(module: torch.nn.Module, tensor: torch.Tensor) -> int:
    """Inputs feeding one output: kernel volume for convolutions, the last dimension otherwise.

    The last dimension is ``in_features`` of a Linear, the width of an embedding row
    (rows of norm ~1), and ``in`` of an expert stack ``[experts, out, in]``.
    """
    if isinstance(module, torch.nn.modules.conv._ConvNd):
        return max(1, math.prod(tensor.shape[1:]))
    return max(1, tensor.shape[-1])
