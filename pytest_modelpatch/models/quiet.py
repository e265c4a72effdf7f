"""The plugin's own loads stay out of the user's output unless ``-v``.

transformers prints progress bars ("Writing model shards", "Loading weights") and
load reports (5.x: "LlamaForCausalLM LOAD REPORT" for missing or unexpected keys)
through its logger; for the plugin's internal loads of tiny or reference models
they are noise. ``pytest -v`` shows them again. Imports transformers only when used.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager

from pytest_modelpatch.settings import SETTINGS


@contextmanager
def quiet_loads() -> Iterator[None]:
    """No progress bars, load reports or transformers warnings inside the block (unless ``-v``: ``SETTINGS.verbose_loads``)."""
    if SETTINGS.verbose_loads:
        yield
        return
    from transformers.utils import logging as transformers_logging

    bars = transformers_logging.is_progress_bar_enabled()
    verbosity = transformers_logging.get_verbosity()
    transformers_logging.disable_progress_bar()
    transformers_logging.set_verbosity_error()
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", module=r"transformers(\.|$)")
            yield
    finally:
        transformers_logging.set_verbosity(verbosity)
        if bars:
            transformers_logging.enable_progress_bar()
