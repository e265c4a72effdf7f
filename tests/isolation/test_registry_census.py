"""Every registry transformers keeps in its modules is watched: a write into one is named, restored and
fails its test; what transformers writes into them itself, while importing, is no leak.

The leak guard once knew two registries by name (the attention and mask interfaces); a kernel
library's loss, experts function, activation or norm registered into any of the others leaked into
every later test unseen. The registries are now found by walking the loaded modules
(``isolation/registries.py``): these tests write into each one a library is known to use.
"""

from __future__ import annotations

import importlib
import re
from importlib import metadata
from typing import NamedTuple

import pytest


class Write(NamedTuple):
    module: str  # where the registry lives in the pinned transformers (absent on an older one: not tested)
    attribute: str
    code: str  # the test body that writes into it, as a library does
    named: str  # the line of the leak report that names it, a glob


WRITES = {
    "loss": Write(
        "transformers.loss.loss_utils", "LOSS_MAPPING",
        "from transformers.loss.loss_utils import LOSS_MAPPING\n    LOSS_MAPPING['CensusLoss'] = census_fn",
        "*transformers.loss.loss_utils.LOSS_MAPPING['CensusLoss'] added (census_fn)",
    ),
    "experts": Write(
        "transformers.integrations.moe", "ExpertsInterface",
        "from transformers.integrations.moe import ExpertsInterface\n"
        "    ExpertsInterface.register('census_experts', census_fn)",
        "*transformers.integrations.moe.ExpertsInterface._global_mapping['census_experts'] added (census_fn)",
    ),
    "parallel-styles": Write(
        "transformers.distributed.parallel_utils", "ALL_PARALLEL_STYLES",
        "from transformers.distributed.parallel_utils import ALL_PARALLEL_STYLES\n"
        "    ALL_PARALLEL_STYLES['census_style'] = census_fn",
        "*ALL_PARALLEL_STYLES._local_mapping['census_style'] added (census_fn)",
    ),
    "rope": Write(
        "transformers.modeling_rope_utils", "ROPE_INIT_FUNCTIONS",
        "from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS\n"
        "    ROPE_INIT_FUNCTIONS['census_rope'] = census_fn",
        "*transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS['census_rope'] added (census_fn)",
    ),
    "hub-kernels": Write(
        "transformers.integrations.hub_kernels", "_HUB_KERNEL_MAPPING",
        "from transformers.integrations.hub_kernels import _HUB_KERNEL_MAPPING\n"
        "    _HUB_KERNEL_MAPPING['CensusNorm'] = {'cuda': 'census/kernels'}",
        "*transformers.integrations.hub_kernels._HUB_KERNEL_MAPPING['CensusNorm'] added (dict)",
    ),
    "exporter-patch": Write(
        "transformers.exporters.utils", "register_patch",
        "from transformers.exporters.utils import register_patch\n"
        "    register_patch('onnx', 'torch.census_op')(census_fn)",
        "*transformers.exporters.utils._PATCHES['onnx']: tuple appended",
    ),
    "exporter-fixes": Write(
        "transformers.exporters.utils", "_FX_NODE_FIXES",
        "from transformers.exporters.utils import _FX_NODE_FIXES\n"
        "    _FX_NODE_FIXES.setdefault('census', []).append(census_fn)",
        "*transformers.exporters.utils._FX_NODE_FIXES['census'] added (list)",
    ),
    "export-backends": Write(
        "transformers.exporters.auto", "EXPORT_BACKENDS",
        "from transformers.exporters.auto import EXPORT_BACKENDS\n    EXPORT_BACKENDS['census'] = census_fn",
        "*transformers.exporters.auto.EXPORT_BACKENDS['census'] added (census_fn)",
    ),
    "quantizers": Write(
        "transformers.quantizers.auto", "AUTO_QUANTIZER_MAPPING",
        "from transformers.quantizers.auto import AUTO_QUANTIZER_MAPPING\n"
        "    AUTO_QUANTIZER_MAPPING['census_quant'] = CensusNorm",
        "*transformers.quantizers.auto.AUTO_QUANTIZER_MAPPING['census_quant'] added (CensusNorm)",
    ),
    "cache-layers": Write(
        "transformers.cache_utils", "DYNAMIC_LAYER_TYPE_MAPPING",
        "from transformers.cache_utils import DYNAMIC_LAYER_TYPE_MAPPING\n"
        "    DYNAMIC_LAYER_TYPE_MAPPING['census_attention'] = CensusNorm",
        "*transformers.cache_utils.DYNAMIC_LAYER_TYPE_MAPPING['census_attention'] added (CensusNorm)",
    ),
    "mask-patterns": Write(
        "transformers.masking_utils", "LAYER_PATTERN_TO_MASK_FUNCTION_MAPPING",
        "from transformers.masking_utils import LAYER_PATTERN_TO_MASK_FUNCTION_MAPPING\n"
        "    LAYER_PATTERN_TO_MASK_FUNCTION_MAPPING['census'] = census_fn",
        "*transformers.masking_utils.LAYER_PATTERN_TO_MASK_FUNCTION_MAPPING['census'] added (census_fn)",
    ),
    "layernorms": Write(
        "transformers.pytorch_utils", "ALL_LAYERNORM_LAYERS",
        "from transformers.pytorch_utils import ALL_LAYERNORM_LAYERS\n    ALL_LAYERNORM_LAYERS.append(CensusNorm)",
        "*transformers.pytorch_utils.ALL_LAYERNORM_LAYERS: CensusNorm appended",
    ),
    "activations": Write(
        "transformers.activations", "ACT2CLS",
        "from transformers.activations import ACT2CLS\n    ACT2CLS['census_act'] = CensusNorm",
        "*transformers.activations.ACT2CLS['census_act'] added (CensusNorm)",
    ),
    "attention": Write(
        "transformers.modeling_utils", "AttentionInterface",
        "from transformers import AttentionInterface\n    AttentionInterface.register('census_attn', census_fn)",
        "*AttentionInterface._global_mapping['census_attn'] added (census_fn)",
    ),
    "removed": Write(
        "transformers.activations", "ACT2CLS",
        "from transformers.activations import ACT2CLS\n    del ACT2CLS['gelu']",
        "*transformers.activations.ACT2CLS['gelu'] removed (was GELUActivation)",
    ),
}  # fmt: skip

HEADER = """
import torch


def census_fn(*args, **kwargs):
    raise NotImplementedError


class CensusNorm(torch.nn.Module):
    pass
"""

# what the writes left, read after them: every registry as it was before
SEES_THE_ORIGINALS = """

def test_z_sees_every_registry_as_it_was():
    from transformers.activations import ACT2CLS
    from transformers.loss.loss_utils import LOSS_MAPPING
    from transformers.pytorch_utils import ALL_LAYERNORM_LAYERS
    from transformers import AttentionInterface
    assert "CensusLoss" not in LOSS_MAPPING
    assert "census_act" not in ACT2CLS and "gelu" in ACT2CLS
    assert CensusNorm not in ALL_LAYERNORM_LAYERS
    assert "census_attn" not in AttentionInterface._global_mapping
"""


def _glob(line: str) -> str:
    return line.replace("[", "[[]")  # fnmatch reads [...] as a set of characters


def _transformers_below(version: tuple[int, int]) -> bool:
    found = re.match(r"(\d+)\.(\d+)", metadata.version("transformers"))
    return found is not None and (int(found[1]), int(found[2])) < version


def _present(write: Write) -> bool:
    try:
        return hasattr(importlib.import_module(write.module), write.attribute)
    except ImportError:
        return False


def test_a_write_into_any_registry_is_named_restored_and_fails_its_test(pytester: pytest.Pytester) -> None:
    present = {name: write for name, write in WRITES.items() if _present(write)}
    # all of them on the pinned transformers; an older one lacks some (5.3: no exporters, no experts interface)
    assert present.keys() == WRITES.keys() or _transformers_below((5, 24)), sorted(WRITES.keys() - present.keys())
    tests = "".join(f"\n\ndef test_{name.replace('-', '_')}():\n    {w.code}\n" for name, w in present.items())
    pytester.makepyfile(test_census=HEADER + tests + SEES_THE_ORIGINALS)
    result = pytester.runpytest("-p", "no:randomly", "-o", "modelpatch_leaks=error")
    result.assert_outcomes(passed=len(present) + 1, errors=len(present))
    for name, write in present.items():
        result.stdout.fnmatch_lines(
            [f"*test_{name.replace('-', '_')} leaked transformers patch state*", _glob(write.named)]
        )


IMPORTS_THAT_REGISTER = """
import importlib
import sys


def test_a_imports_modules_that_register_into_other_modules_registries():
    import transformers.exporters.utils as utils
    before = len(utils._PATCHES.get("dynamo", []))
    # a first import, whatever imported it before (transformers 5.17's exporters package does, eagerly)
    sys.modules.pop("transformers.exporters.exporter_dynamo", None)
    importlib.import_module("transformers.exporters.exporter_dynamo")  # its @register_patch fills _PATCHES["dynamo"]
    assert len(utils._PATCHES["dynamo"]) > before


def test_b_still_sees_what_importing_wrote():
    import transformers.exporters.utils as utils
    assert utils._PATCHES["dynamo"]
"""


def test_what_transformers_registers_while_importing_is_no_leak(pytester: pytest.Pytester) -> None:
    if not _present(Write("transformers.exporters.exporter_dynamo", "__name__", "", "")):
        pytest.skip("this transformers has no exporters (5.21 and later)")
    pytester.makepyfile(test_imports=IMPORTS_THAT_REGISTER)
    result = pytester.runpytest("-p", "no:randomly", "-o", "modelpatch_leaks=error")
    result.assert_outcomes(passed=2)


REMOTE_LIKE = """
import sys
import types


def test_a_registers_a_class_defined_by_code_it_loaded():
    from transformers.activations import ACT2CLS
    module = types.ModuleType("transformers_modules.census.modeling_census")
    exec("class CensusActivation:\\n    pass", module.__dict__)
    sys.modules[module.__name__] = module
    ACT2CLS["census_remote"] = module.CensusActivation  # what a trust_remote_code load does


def test_b_still_sees_it():
    from transformers.activations import ACT2CLS
    assert "census_remote" in ACT2CLS
"""


def test_what_remote_code_registers_is_transformers_own(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_remote=REMOTE_LIKE)
    result = pytester.runpytest("-p", "no:randomly", "-o", "modelpatch_leaks=error")
    result.assert_outcomes(passed=2)
