"""Export and compile parity: real pytest runs on the tiny Llama, with the example patches in fixtures/.

The NaN-guard MLP is the broken example: eager-correct (assert_equivalent passes), yet export
and fullgraph compile must fail naming its ``if`` line and class, and compile without fullgraph
must count and locate its graph breaks. The RoPE rewrite (onnx-diagnostic style) and the fused
QKV attention are the good ones: they export with dynamic batch and sequence and match at two shapes.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import REPO_ROOT, Pair

GUARD_LINE = next(
    number
    for number, line in enumerate((REPO_ROOT / "fixtures/patches/llama_nan_guard_mlp.py").read_text().splitlines(), 1)
    if line.strip().startswith("if torch.isnan(out).any():")
)

CHECKS = """
import pytest
from fixtures.patches import llama_export_rope as rope, llama_fused_qkv as fused, llama_nan_guard_mlp as guard
from pytest_modelpatch import assert_compiles_equivalent, assert_equivalent, assert_exports_equivalent


def short_failure(check):
    with pytest.raises(AssertionError) as failure:
        check()
    message = str(failure.value)
    assert len(message.splitlines()) <= 8 and "GraphModule" not in message, message  # no 200-line trace
    print(message)


@pytest.mark.model("llama")
@pytest.mark.patch(methods=rope.METHODS)
def test_rope_rewrite_exports_with_dynamic_shapes(reference_model, patched_model):
    report = assert_exports_equivalent(reference_model, patched_model, dynamic=True)
    assert [c.path for c in report.comparisons] == ["logits_2x8", "logits_3x11"] and report.max_abs_error == 0


@pytest.mark.model("llama")
@pytest.mark.patch(fused.MAPPING, conversions=fused.CONVERSIONS)
def test_fused_qkv_exports_dynamic_and_compiles_fullgraph(reference_model, patched_model):
    report = assert_exports_equivalent(reference_model, patched_model, dynamic=True)
    assert [c.path for c in report.comparisons] == ["logits_2x8", "logits_3x11"]
    print(assert_compiles_equivalent(reference_model, patched_model, backend="aot_eager", fullgraph=True))


@pytest.mark.model("llama")
@pytest.mark.patch(methods=guard.METHODS)
def test_nan_guard_is_eager_correct_and_breaks_tracing(reference_model, patched_model):
    assert assert_equivalent(reference_model, patched_model).max_abs_error == 0
    short_failure(lambda: assert_exports_equivalent(reference_model, patched_model))
    short_failure(lambda: assert_compiles_equivalent(reference_model, patched_model, backend="eager", fullgraph=True))
    report = assert_compiles_equivalent(reference_model, patched_model, backend="eager")
    print("BREAKS:", report.breaks_text())
    short_failure(lambda: assert_compiles_equivalent(reference_model, patched_model, backend="eager", max_graph_breaks=1))


@pytest.mark.model("llama")
@pytest.mark.patch(methods=guard.METHODS)
def test_export_failure_as_pytest_shows_it(reference_model, patched_model):
    assert_exports_equivalent(reference_model, patched_model, strict=True)
"""


def test_export_and_compile_checks_pass_good_patches_and_locate_the_broken_one(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_parity=CHECKS)
    result = pytester.runpytest_subprocess("-p", "no:randomly", "-s", "--modelpatch-report", "report.json")
    result.assert_outcomes(passed=3, failed=1)
    where = f"*fixtures/patches/llama_nan_guard_mlp.py:{GUARD_LINE} in forward, LlamaMLP.forward at model.layers.0.mlp (rebound to patched_LlamaMLP.forward)"
    result.stdout.fnmatch_lines([
        f"*torch.export.export(strict=False) failed on patched LlamaForCausalLM: broke at {where}",
        "    if torch.isnan(out).any():*",
        "torch says (GuardOnDataDependentSymNode): Could not guard on data-dependent expression*",
        "how to fix: The code branches on (or reads out) a tensor's values*torch.cond*",
        f"torch.compile(backend='eager', fullgraph=True) failed on patched LlamaForCausalLM: broke at {where}",
        "torch says (Unsupported): Data-dependent branching*",
        f"BREAKS: 2 graph breaks: *fixtures/patches/llama_nan_guard_mlp.py:{GUARD_LINE} (LlamaMLP.forward) x2",
        "torch.compile(backend='eager', fullgraph=False) of patched LlamaForCausalLM differs from eager reference*",
        f"more than max_graph_breaks=1; first at {where}",
        f"E * torch.export.export(strict=True) failed on patched LlamaForCausalLM: broke at {where}",
    ])  # fmt: skip
    rows = json.loads(Path(pytester.path, "report.json").read_text())["rows"]
    kinds = [(row["kind"], row["outcome"]) for row in rows if row["kind"] in ("export", "compile")]
    assert sorted(kinds) == sorted([
        ("export", "passed"), ("export", "passed"), ("compile", "passed"), ("export", "failed"),
        ("compile", "failed"), ("compile", "passed"), ("compile", "failed"), ("export", "failed"),
    ])  # fmt: skip
    breaks = next(
        r
        for r in rows
        if r["kind"] == "compile" and r["outcome"] == "passed" and "eager" in r["detail"] and "'eager'" in r["detail"]
    )
    assert "2 graph breaks" in breaks["detail"]


def test_compiled_code_and_dynamo_globals_do_not_outlive_the_check(pair: Callable[..., Pair]) -> None:
    import sys

    import torch

    from pytest_modelpatch.compare.graph.compile import assert_compiles_equivalent

    before = {name: set(vars(module)) for name, module in list(sys.modules.items()) if module is not None}
    assert_compiles_equivalent(*pair("llama_fused_qkv"), backend="eager")
    added = {
        f"{name}.{key}" for name, module in list(sys.modules.items()) if module is not None
        for key in set(vars(module)) - before.get(name, set()) if key.startswith("__") and "__" in key[2:]
        and key.startswith(("__import_", "__resume_at_", "__builtins_dict__", "__compiled_fn_"))
    }  # fmt: skip
    assert not added
    assert not torch._dynamo.convert_frame.input_codes.seen


def test_without_a_cpp_compiler_the_default_backend_is_aot_eager_with_a_note(monkeypatch: pytest.MonkeyPatch) -> None:
    from pytest_modelpatch.compare.graph.compile import default_backend

    assert default_backend()[0] == ("inductor" if __import__("shutil").which("g++") else "aot_eager")
    monkeypatch.setenv("PATH", "")
    backend, note = default_backend()
    assert backend == "aot_eager" and "no C++ compiler" in note


def test_dynamic_export_refuses_size_one_examples(pair: Callable[..., Pair]) -> None:
    import torch

    from pytest_modelpatch.compare.graph.export import assert_exports_equivalent
    from pytest_modelpatch.errors import PatchUsageError

    with pytest.raises(PatchUsageError, match="batch and sequence >= 2 .got 1x8.*fixes a dimension of size 1"):
        assert_exports_equivalent(*pair("llama_fused_qkv"), torch.ones(1, 8, dtype=torch.long), dynamic=True)
