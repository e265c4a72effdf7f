"""Whether a family can take what a test asks of its loads: transformers' own refusals, read as "not applicable".

A kernel author who sweeps ``attn_implementation="sdpa"`` (or ``experts_implementation=``, a
transform, a ``from_pretrained`` keyword) over every family meets families that cannot take it:
transformers refuses, with a ``ValueError`` such as ``XLMWithLMHeadModel does not support an
attention implementation through torch.nn.functional.scaled_dot_product_attention yet``. That is
not a broken model; the fixtures skip it in a sweep and error alone (``fixtures.py``).
:func:`load_refusal` finds an implementation's refusal on the meta device, in milliseconds, before
any checkpoint is written; :func:`transformers_refusal` recognises one raised by a real load.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from pytest_modelpatch.isolation.per_test.patch_spec import IMPLEMENTATIONS

# the words transformers' refusals of a feature a model lacks share (5.x): "X does not support ..."
_REFUSAL = re.compile(r"\bdoes not support\b")
_REFUSED_TYPES = (ValueError, NotImplementedError)


def _transformers_dir() -> Path:
    import transformers

    return Path(transformers.__file__).resolve().parent


def transformers_refusal(exc: BaseException) -> str | None:
    """transformers' message when ``exc`` is its refusal of a feature the model lacks, else ``None``.

    Only a ``ValueError`` or ``NotImplementedError`` that transformers itself raised (the innermost
    frame is in its package) and that says "does not support": a user's own error, or transformers
    failing for another reason, is not a refusal and stays an error.
    Example: ``transformers_refusal(exc)`` -> ``"XLMWithLMHeadModel does not support an attention ..."``.
    """
    if not isinstance(exc, _REFUSED_TYPES) or not _REFUSAL.search(str(exc)):
        return None
    tb = exc.__traceback__
    if tb is None:
        return None
    while tb.tb_next is not None:
        tb = tb.tb_next
    raised_in = Path(tb.tb_frame.f_code.co_filename).resolve()
    if not raised_in.is_relative_to(_transformers_dir()):
        return None
    return " ".join(str(exc).split())  # one line: pytest prints a skip's reason on one


def load_refusal(request: Any, load_kwargs: Mapping[str, Any]) -> str | None:
    """transformers' refusal of ``load_kwargs``' implementations for ``request``'s model, else ``None``.

    Builds the model class on the meta device with them, which runs the checks ``from_pretrained``
    runs in ``__init__`` (composite models' towers included) without a checkpoint or a weight.
    Anything else that goes wrong here is left to the real load to report.
    """
    axes = {axis: value for axis, value in load_kwargs.items() if axis in IMPLEMENTATIONS and value}
    if not axes:
        return None
    from pytest_modelpatch.families.catalog import model_class_for
    from pytest_modelpatch.models.checkpoints import checkpoint_model_class
    from pytest_modelpatch.models.quiet import quiet_loads

    spec = request.model_spec
    try:
        own = spec.source_dir is not None and not request.overrides  # its own class, as the builder loads it
        cls = checkpoint_model_class(spec.source_dir) if own else model_class_for(spec.config)
        with quiet_loads(), torch.device("meta"):
            cls._from_config(copy.deepcopy(spec.config), **axes)
    except Exception as exc:  # noqa: BLE001 - only a refusal is an answer; the real load reports the rest
        return transformers_refusal(exc)
    return None
