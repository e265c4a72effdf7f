"""The kernels library's route: ``kernels.kernelize`` with a local CPU kernel repository, as a transform.

transformers marks its norms ``@use_kernel_forward_from_hub("RMSNorm")``; ``kernelize`` binds a
kernel layer's ``forward`` to each such module of a loaded model. On the patch marker that is a
transform of the patched model only, so the reference runs transformers' own norm. The layers are
the local repositories in ``fixtures/kernels/``: one correct, one without ``variance_epsilon``.
Needs ``kernels`` at a version the installed transformers accepts: CI's transformers 5.17 lane
installs kernels 0.16.2 (transformers 5.24 wants ``kernels>=0.18.2``, which the package registry
here lacks). ``use_kernels=True`` needs a GPU on those versions; what reaches the patched load is
tested in ``test_load_choices.py``.
"""

from __future__ import annotations

import pytest
from _support.runs import IN_ORDER

pytest.importorskip("kernels", reason="the kernels package (CI's transformers 5.17 lane installs kernels 0.16.2)")

KERNELIZED = """
import pytest
from fixtures.patches import mechanisms
from pytest_modelpatch import assert_equivalent, assert_decodes_equivalent


@pytest.mark.model("llama")
@pytest.mark.patch(transform=mechanisms.kernelized("fixture-rmsnorm"))
def test_good_kernel(reference_model, patched_model):
    # the kernel runs in the patched model only: else the comparison would prove nothing
    assert "fixtures/kernels/fixture-rmsnorm/" in patched_model.model.norm.forward.__code__.co_filename
    assert "forward" not in vars(reference_model.model.norm)
    assert_equivalent(reference_model, patched_model)
    assert_decodes_equivalent(reference_model, patched_model)


@pytest.mark.model("llama")
@pytest.mark.patch(transform=mechanisms.kernelized("fixture-rmsnorm-no-eps"))
def test_kernel_without_epsilon(reference_model, patched_model):
    assert_equivalent(reference_model, patched_model)
"""


def test_a_local_kernel_through_kernelize_passes_and_its_buggy_twin_fails(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_kernels=KERNELIZED)
    result = pytester.runpytest(*IN_ORDER, "-rA")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines([
        "*first diverging module: *norm* (LlamaRMSNorm)*",
        "PASSED test_kernels.py::test_good_kernel",
        "FAILED test_kernels.py::test_kernel_without_epsilon - AssertionError: patched*",
    ], consecutive=False)  # fmt: skip
