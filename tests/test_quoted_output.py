"""The comparison of quoted output with real output: round-off forgiven in figures, nothing else."""

from __future__ import annotations

from _support.quoted_output import same_line, same_lines

ROW = "xfailed  1.37      700       equivalence#1  LlamaForCausalLM     float32@cpu   docs/examples/t.py::test_scale"
PASSED = "passed   5.36e-06  0.0247    equivalence#1  Qwen3VLModel         float32@cpu   docs/examples/t.py::test_vl"


def test_a_failing_checks_figures_agree_up_to_cpu_round_off() -> None:
    assert same_line(ROW, ROW.replace("700 ", "699 "))  # %.3g prints 699.6 as 700: not an integer
    assert same_line(ROW, ROW.replace("1.37", "1.38"))
    assert same_line(
        ROW.replace("700 ", "5.04e+03"), ROW.replace("700 ", "5.12e+03")
    )  # a max rel: 2% (kernel sets differ)
    assert not same_line(ROW.replace("700 ", "5.04e+03"), ROW.replace("700 ", "5.5e+03 "))  # 9%: not round-off
    assert same_line(ROW.replace("1.37", "0.147"), ROW.replace("1.37", "0.148"))  # one unit of the last digit


def test_a_failing_checks_figures_that_really_moved_do_not_agree() -> None:
    assert not same_line(ROW, ROW.replace("1.37", "1.39"))  # a max abs 1.4% apart: a change, not round-off
    assert not same_line(ROW, ROW.replace("1.37", "2.37"))
    assert not same_line(ROW, ROW.replace("1.37", "-   "))  # a figure that vanished
    assert not same_line(ROW, ROW.replace("700 ", "nan "))


def test_a_passing_checks_figures_are_round_off_under_its_tolerance() -> None:
    assert same_line(PASSED, PASSED.replace("5.36e-06  0.0247 ", "4.71e-06  0.00519"))
    assert not same_line(PASSED, PASSED.replace("5.36e-06", "-       "))  # no figure is not a figure


def test_outcomes_ids_and_counts_compare_exactly() -> None:
    assert not same_line(ROW, ROW.replace("xfailed", "failed "))
    assert not same_line(PASSED, PASSED.replace("passed ", "xpassed"))
    assert not same_line(ROW, ROW.replace("test_scale", "test_scalf"))
    assert not same_line(ROW, ROW.replace("equivalence#1", "equivalence#2"))
    assert not same_line("E   896/1024 elements over tolerance", "E   895/1024 elements over tolerance")
    assert not same_line("worst at [1, 3, 1, 15]", "worst at [1, 3, 1, 14]")
    assert not same_line("12 passed, 13 xfailed in Ns", "12 passed, 12 xfailed in Ns")


def test_figures_in_other_lines_agree_up_to_round_off_and_text_exactly() -> None:
    assert same_line("max rel 312.3; reference 0.911082", "max rel 312.2; reference 0.911081")
    assert same_line("patched 1.0322 (allowed 1.37e-05)", "patched 1.03221 (allowed 1.37e-05)")
    assert same_line("max abs 4.297 at", "max abs 4.301 at")  # under a thousandth apart
    assert not same_line("max rel 312.3", "max rel 340.0")  # 9%
    assert not same_line("max abs 3.123", "max abs 3.180")  # 1.8%: a max abs is not a ratio to near-zero elements
    assert not same_line("max abs 4.297", "max rel 4.297")
    assert not same_line("reference 0.5", "reference -0.5")


def test_a_whole_figure_in_a_failure_line_is_a_figure_and_a_count_is_not() -> None:
    line = "896/1024 elements over tolerance; max abs 3.954, max rel 3177; worst at [1, 3, 2, 7]"
    assert same_line(line, line.replace("3177", "3176"))  # %.4g of 3176.6 or 3176.4: round-off
    assert same_line(line, line.replace("3177", "3218"))  # a max rel: 1.3%
    assert not same_line(line, line.replace("[1, 3, 2, 7]", "[1, 3, 2, 6]"))
    assert not same_line(line, line.replace("896/", "897/"))


BF16_TRAINING = (
    "xfailed  0.969     3.85e+03  training#1     LlamaForCausalLM     bfloat16@cpu     "
    "docs/examples/t.py::test_late[bfloat16]"
)
FP32_TRAINING = (
    "xfailed  0.572     103       training#1     LlamaForCausalLM     float32@cpu      docs/examples/t.py::test_stale"
)


def test_a_failing_bf16_training_row_matches_any_figures_wherever_it_sorts() -> None:
    moved = BF16_TRAINING.replace("0.969     3.85e+03", "2.38      2.99e+03")
    assert same_lines([ROW, BF16_TRAINING, FP32_TRAINING], [moved, ROW, FP32_TRAINING])
    assert not same_lines([ROW, BF16_TRAINING], [ROW, moved.replace("xfailed", "failed ")])  # its outcome is exact
    assert not same_lines([ROW, BF16_TRAINING], [ROW, moved.replace("test_late", "test_lade")])  # and its id
    assert not same_lines([ROW, BF16_TRAINING], [ROW, FP32_TRAINING])  # it is there
    # an fp32 training row is judged as any failing row: its figures up to round-off, its place exact
    assert not same_lines([ROW, FP32_TRAINING], [FP32_TRAINING, ROW])
    assert not same_line(FP32_TRAINING, FP32_TRAINING.replace("0.572", "0.672"))
