"""pytest wiring for pytest-modelpatch: options, ini keys, markers, hooks; the fixtures are in
:mod:`.fixtures` (registered in ``pytest_configure``), what a test item asks for in :mod:`.item_markers`.

Nothing here imports torch or transformers at module level; the modules that do
the work are imported inside the hooks that need them.
"""

from __future__ import annotations

import os
import re
from collections.abc import Generator, Iterator, Mapping
from typing import Any

import pytest

from pytest_modelpatch import fixtures
from pytest_modelpatch.errors import PatchUsageError
from pytest_modelpatch.fixtures import checkpoint_root, validate_before_ranks
from pytest_modelpatch.isolation.interception import hold_for_session
from pytest_modelpatch.isolation.per_test.leaks import LeakTally
from pytest_modelpatch.isolation.per_test.patch_spec import PATCH_MARKER_HELP, collect_patch_spec
from pytest_modelpatch.isolation.per_test.scopes import IsolationScopes, leak_mode
from pytest_modelpatch.item_markers import (
    CHECKPOINTS_ENV,
    FAMILY_PARAM,
    GPU_SKIP,
    NoCallspec,
    defer_usage_error,
    item_device,
    item_model_request,
    name_misspelled_marker,
    no_match_allowed,
    patched_sweep_family,
    raise_usage_error,
    resolve_device,
    swept_family,
)
from pytest_modelpatch.models import devices
from pytest_modelpatch.models.memory_cache import parse_model_cache
from pytest_modelpatch.parallel.launcher import LauncherSession, keep_outputs_on_rank_zero, launched_rank
from pytest_modelpatch.parallel.marker import PARALLEL_MARKER_HELP, ParallelSpec
from pytest_modelpatch.parallel.session import ParallelSession, in_rank
from pytest_modelpatch.reporting import session
from pytest_modelpatch.reporting.records import set_record_sink
from pytest_modelpatch.reporting.session import SWEEP_PROPERTY, CheckSink
from pytest_modelpatch.settings import IMPLEMENTATION_KEYWORDS, configure_checks

_ISOLATION = pytest.StashKey[IsolationScopes]()


MARKERS = {
    "patch": PATCH_MARKER_HELP,
    "cpu": "cpu: run this test on the CPU; the device fixture is 'cpu' whatever --modelpatch-device says",
    "gpu": "gpu: needs a CUDA GPU; skipped with a reason when there is none (a failure under --modelpatch-require-gpu)",
    "devices": "devices(*names): run the test once per device, e.g. devices('cpu', 'cuda'); sets the device fixture",
    "dtypes": "dtypes(*dtypes): run the test once per dtype, e.g. dtypes('float32', 'bfloat16'); sets the dtype fixture",
    "model": "model(spec, *, seed=0, init='modelpatch', "
    + "".join(f"{axis}=None, " for axis in IMPLEMENTATION_KEYWORDS)
    + "fusion_config=None, transform=None, **config_overrides): the model behind reference_model and patched_model: "
    "a model type ('llama'), a PretrainedConfig or a local checkpoint directory, or a list of model types to run the "
    "test once per type; families='patched' runs it once per family the test's patches reach (towers of composite "
    "models included), families='all' once per family; transform=fn(model) reaches both models (a LoRA both "
    "train); an unknown keyword is a usage error",
    "tolerance": "tolerance(*, atol=None, rtol=None, policy=None): tolerance for this test's equivalence checks "
    "(arguments > this marker > modelpatch_atol/modelpatch_rtol ini > the per-dtype policy)",
    "parallel": PARALLEL_MARKER_HELP,
}


# ---------------------------------------------------------------------------
# options, ini keys, markers
# ---------------------------------------------------------------------------


def _device_option(value: str) -> str:
    try:
        return devices.parse_device(value)
    except PatchUsageError as exc:
        raise pytest.UsageError(f"--modelpatch-device: {exc}") from None


def _seed_option(value: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise pytest.UsageError(
            f"--modelpatch-seed {value!r}: expected an integer, e.g. --modelpatch-seed 1234"
        ) from None


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("modelpatch", "verify patched transformers models (pytest-modelpatch)")
    group.addoption(
        "--modelpatch-device",
        dest="modelpatch_device",
        type=_device_option,
        default=None,
        metavar="DEVICE",
        help=f"default device for the device fixture: cpu, cuda, cuda:N or auto (env ${devices.DEVICE_ENV}; "
        "default cpu). Under xdist with several GPUs, bare 'cuda' gives each worker its own.",
    )
    group.addoption(
        "--modelpatch-require-gpu",
        dest="modelpatch_require_gpu",
        action="store_true",
        default=False,
        help="fail, instead of skipping, tests that need a GPU when none is available (for GPU CI).",
    )
    group.addoption(
        "--modelpatch-checkpoint",
        dest="modelpatch_checkpoint",
        default=None,
        metavar="PATH",
        help="default model for reference_model/patched_model when a test has no @pytest.mark.model: "
        "a local checkpoint directory or a model type such as 'llama'.",
    )
    parser.addini("modelpatch_atol", "absolute tolerance for equivalence checks (default: per-dtype policy)")
    parser.addini("modelpatch_rtol", "relative tolerance for equivalence checks (default: per-dtype policy)")
    parser.addini(
        "modelpatch_tolerance_policy",
        "named tolerance policy: default, strict, loose, sqnr, sqnr:DB, oracle or oracle:FACTOR",
        default="",
    )
    leaks_help = (
        "what to do when a test leaves transformers patch state changed: error, warn or off "
        "(default: error for tests that use a modelpatch marker or fixture, warn for the rest)"
    )
    parser.addini("modelpatch_leaks", leaks_help, default="")
    group.addoption(
        "--modelpatch-leaks",
        dest="modelpatch_leaks",
        default=None,
        metavar="MODE",
        help=f"{leaks_help}; overrides the modelpatch_leaks ini key",
    )
    group.addoption(
        "--modelpatch-seed",
        dest="modelpatch_seed",
        type=_seed_option,
        default=None,
        metavar="N",
        help="session seed for property checks, sent to every xdist worker (default: ini modelpatch_seed, else 0)",
    )
    group.addoption(
        "--modelpatch-report",
        dest="modelpatch_report",
        default=None,
        metavar="PATH",
        help="write every check's row (errors, tolerance, device and its class, patches), a header, "
        "the tests selected and each test's outcome to PATH as JSON",
    )
    group.addoption(
        "--modelpatch-baseline",
        dest="modelpatch_baseline",
        default=None,
        metavar="PATH",
        help="fail the session when a check's max error grew beyond this earlier report's row of its device "
        "class, or a check of a test it selected vanished",
    )
    group.addoption(
        "--modelpatch-update-baseline",
        dest="modelpatch_update_baseline",
        action="store_true",
        default=False,
        help="rewrite --modelpatch-baseline PATH with this run's checks instead of comparing: the rows of "
        "the tests and devices it ran are replaced, the others kept",
    )
    group.addoption(
        "--modelpatch-html",
        dest="modelpatch_html",
        default=None,
        metavar="PATH",
        help="write an HTML page with the divergence profile of each failing equivalence check",
    )
    group.addoption(
        "--modelpatch-verify-cache",
        dest="modelpatch_verify_cache",
        action="store_true",
        default=False,
        help="hash every file of each cached tiny checkpoint before use (default: sizes and safetensors headers)",
    )
    group.addoption(
        "--modelpatch-timing",
        dest="modelpatch_timing",
        action="store_true",
        default=False,
        help="time reference and patched forwards of each equivalence check (median, peak memory): "
        "'timing' on report rows, a speedup column",
    )
    parser.addini(
        "modelpatch_timing",
        "time each equivalence check's forwards, as --modelpatch-timing (default false)",
        type="bool",
        default=False,
    )
    parser.addini(
        "modelpatch_min_speedup", "gate: fail the session when a timed check's speedup is below this", default=""
    )
    parser.addini(
        "modelpatch_max_speedup_drop",
        "gate: fail when a timed check's speedup fell more than this fraction below the baseline's",
        default="",
    )
    parser.addini(
        "modelpatch_model_cache",
        "reference models kept in memory: a count (8) or a size (512MB); "
        "least recently used released first (default: all)",
        default="",
    )
    parser.addini("modelpatch_seed", "session seed for property checks (default 0)", default="")
    parser.addini(
        "modelpatch_max_abs_error", "gate: fail the session when a check's max abs error exceeds this", default=""
    )
    parser.addini(
        "modelpatch_max_rel_error", "gate: fail the session when a check's max rel error exceeds this", default=""
    )
    parser.addini(
        "modelpatch_baseline_factor",
        "gate: allowed growth of max abs error over the baseline (default 2.0)",
        default="",
    )
    parser.addini(
        "modelpatch_baseline_floor", "gate: growth below this absolute amount always passes (default 1e-6)", default=""
    )


def pytest_configure(config: pytest.Config) -> None:
    # registered as the module object this file imported, not named in pytest_plugins: pytest would
    # mark that name for assertion rewriting after the import above, and warn on every editable install
    # (PytestAssertRewriteWarning, an error under -W error); the fixtures assert nothing to rewrite
    if not config.pluginmanager.is_registered(fixtures):
        config.pluginmanager.register(fixtures, "pytest_modelpatch.fixtures")
    for line in MARKERS.values():
        config.addinivalue_line("markers", line)
    try:
        leaks = leak_mode(config)
        parse_model_cache(config.getini("modelpatch_model_cache"))
        default_device = devices.requested_device(config.getoption("modelpatch_device"))
        launched = launched_rank()
    except PatchUsageError as exc:
        raise pytest.UsageError(str(exc)) from None
    if launched is not None:  # under torchrun or srun: this session is one rank of the launcher's group
        if config.getoption("numprocesses", None):
            raise pytest.UsageError(
                f"-n {config.getoption('numprocesses')} under a launcher ({launched}): each of the launcher's "
                "processes is one rank and runs its tests itself; drop -n (xdist's workers would all be that rank)"
            )
        keep_outputs_on_rank_zero(config, launched)
    session.configure(config, default_device)
    config.pluginmanager.register(LeakTally(leaks), "modelpatch-leak-tally")
    scopes = IsolationScopes(
        leaks, lint_for=_registration_lint, tolerance_for=_set_test_tolerance, opted_in=_uses_plugin,
        plugin_fixtures=PLUGIN_FIXTURES,
    )  # fmt: skip
    config.pluginmanager.register(scopes, "modelpatch-isolation")
    config.stash[_ISOLATION] = scopes  # its report part runs inside pytest_runtest_makereport below
    if launched is not None:
        backend = "nccl" if devices.needs_gpu(default_device) else "gloo"
        config.pluginmanager.register(
            LauncherSession(config, launched, backend, validate_before_ranks), "modelpatch-launcher"
        )
    elif not in_rank():  # a rank runs the tests it is sent; the process that sent them runs them in ranks

        def rank_env() -> dict[str, str]:
            # pytest's tmpdir plugin sets _tmp_path_factory in its pytest_configure; Config declares no such attribute
            return {CHECKPOINTS_ENV: str(checkpoint_root(config._tmp_path_factory))}  # type: ignore[attr-defined]

        config.pluginmanager.register(
            ParallelSession(config, session.session_seed(config), _parallel_backend, rank_env, validate_before_ranks),
            "modelpatch-parallel",
        )
    hold_for_session(True)
    _configure_settings(config)


def _configure_settings(config: pytest.Config) -> None:
    """Set the session's settings, ``settings.SETTINGS``, the one place models/ and compare/ read them.

    Each xdist worker sets them too, with the controller's seed and its own reading of the options.
    """
    previous = configure_checks(
        seed=session.session_seed(config),
        timing=bool(config.getoption("modelpatch_timing") or config.getini("modelpatch_timing")),
        verbose_loads=config.get_verbosity() > 0,
        full_verification=bool(config.getoption("modelpatch_verify_cache")),
    )

    def restore() -> None:  # an in-process pytester run must not leave them set
        configure_checks(**previous)

    config.add_cleanup(restore)


def pytest_unconfigure(config: pytest.Config) -> None:
    hold_for_session(False)


# ---------------------------------------------------------------------------
# collection and setup: sweeps, devices and dtypes
# ---------------------------------------------------------------------------


def _sweep_families(metafunc: pytest.Metafunc) -> None:
    """``@pytest.mark.model(["llama", "gemma"])``, or ``families="patched"``/``"all"``: one test per model type."""
    mark = metafunc.definition.get_closest_marker("model")
    if mark is None:
        return
    where = f"@pytest.mark.model on {metafunc.definition.nodeid}"
    if "families" in mark.kwargs:
        if mark.args:
            raise PatchUsageError(f"{where}: families= chooses the model types; drop the positional {mark.args[0]!r}.")
        from pytest_modelpatch.models.sweeps import sweep_families

        try:
            keys, optional = _patched_class_names(metafunc.definition)
            swept = sweep_families(mark.kwargs["families"], keys, may_match_nothing=optional)
        except PatchUsageError as exc:  # collection errors name the file only: name the test
            raise PatchUsageError(f"{where}: {exc}") from None
        params = [pytest.param(f.model_type, id=f.model_type, marks=[pytest.mark.skip(reason=f.skip)] if f.skip else [])
                  for f in swept]  # fmt: skip
    elif mark.args and isinstance(mark.args[0], (list, tuple)):
        families = list(mark.args[0])
        if not families or not all(isinstance(f, str) and f for f in families) or len(set(families)) != len(families):
            raise PatchUsageError(
                f"@pytest.mark.model({families!r}) on {metafunc.definition.nodeid}: a sweep is a list of distinct model "
                "types, e.g. @pytest.mark.model(['llama', 'mistral']), or families='patched' or 'all'."
            )
        params = [pytest.param(family, id=family) for family in families]
    else:
        return
    metafunc.fixturenames.append(FAMILY_PARAM)
    metafunc.parametrize(FAMILY_PARAM, params)


def _patched_class_names(node: pytest.Item) -> tuple[list[str], set[str]]:
    """The class mapping's keys and the classes method patches patch (what families="patched" follows), and of
    those the ones a sweep may find replacing nothing: keys whose NO_MATCH is allowed, and the method patches'
    classes (no allow= can name them)."""
    spec = collect_patch_spec(node)
    if spec is None:
        return [], set()
    named = [getattr(getattr(m, "_PATCHED_CLASS_", None), "__name__", None) for m in spec.methods]
    methods = [re.escape(name) for name in named if name]
    return [*spec.mapping, *methods], no_match_allowed(spec.allow) | set(methods)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    try:
        _parametrize(metafunc)
    except PatchUsageError as exc:  # this test's items fail at setup with it; every other test runs
        defer_usage_error(metafunc, exc)


def _parametrize(metafunc: pytest.Metafunc) -> None:
    _sweep_families(metafunc)
    for marker, argname, parse in (
        ("devices", "device", devices.parse_device),
        ("dtypes", "dtype", devices.dtype_name),
    ):
        mark = metafunc.definition.get_closest_marker(marker)
        if mark is None:
            continue
        if not mark.args or mark.kwargs:
            raise PatchUsageError(
                f"@pytest.mark.{marker} needs one or more positional values, e.g. "
                f"@pytest.mark.{marker}({'cpu' if argname == 'device' else 'float32'!r}, ...)."
            )
        if argname not in metafunc.fixturenames:
            raise PatchUsageError(
                f"@pytest.mark.{marker} on {metafunc.definition.nodeid} sets the {argname!r} fixture, "
                f"but the test does not use it: add {argname!r} to its arguments."
            )
        try:
            names = [parse(value) for value in mark.args]
        except PatchUsageError as exc:  # collection errors name the file only: name the test and the marker
            raise PatchUsageError(
                f"@pytest.mark.{marker}{mark.args!r} on {metafunc.definition.nodeid}: {exc}"
            ) from None
        params = [
            pytest.param(name, marks=[pytest.mark.gpu] if argname == "device" and devices.needs_gpu(name) else [])
            for name in names
        ]
        metafunc.parametrize(argname, params, ids=names, indirect=True)


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(
    collector: pytest.Collector,
) -> Generator[None, pytest.CollectReport, pytest.CollectReport]:
    report = yield
    if report.failed:
        name_misspelled_marker(report, tuple(MARKERS))
    return report


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Iterator[None]:
    raise_usage_error(item, tuple(MARKERS))
    if "gpu" in item.keywords and item.get_closest_marker("gpu") is not None:
        if item.get_closest_marker("cpu") is not None and "device" not in getattr(item, "callspec", NoCallspec).params:
            raise PatchUsageError(f"{item.nodeid} is marked both cpu and gpu: keep one.")
        resolve_device(item, item_device(item))
    return (yield)


# The plugin's one outermost wrapper (tryfirst), so it sees the report after pytest's xfail handling.
# Its parts, in this order: first what the test itself came to (its checks' intent, a GPU skip pointed
# at the test, a sweep's family), then the leaks of the phase, which may turn an xfail into a failure:
# the intent is read from the outcome the test had before a leak overrode it, as it was when these
# were two wrappers and the isolation one the outer.
@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    _describe_report(item, report)
    scopes = item.config.stash.get(_ISOLATION, None)
    if scopes is not None:
        scopes.stamp_report(item, call, report)
    return report


def _describe_report(item: pytest.Item, report: pytest.TestReport) -> None:
    """What the test came to: its checks' intent, a GPU skip pointed at the test, the family a sweep gave it."""
    if item.user_properties:
        from pytest_modelpatch.reporting.session import stamp_intent

        stamp_intent(item, report)
    reason = item.stash.get(GPU_SKIP, None)
    if reason is not None and report.skipped and isinstance(report.longrepr, tuple):
        # point the skip at the test, as pytest does for its own skip marks
        path, line, _ = item.reportinfo()
        report.longrepr = (str(path), (line or 0) + 1, f"Skipped: {reason}")
    family = swept_family(item)
    if family is not None:  # the controller groups a sweep's outcomes by test (under xdist it has no items)
        report.user_properties.append((SWEEP_PROPERTY, family))


# ---------------------------------------------------------------------------
# patch isolation: isolation.per_test.scopes.IsolationScopes (registered in pytest_configure) holds each
# test's scope; these are the parts of it that read other rooms, which isolation may not import
# ---------------------------------------------------------------------------


def fixtures_of(namespace: Mapping[str, Any]) -> frozenset[str]:
    """The names of the pytest fixtures in a module's namespace, as pytest registers them from it."""
    # pytest has no public test for a fixture function that holds from 8.0 (a marked function) to 9
    # (a FixtureFunctionDefinition); this is the one it uses itself
    from _pytest.fixtures import getfixturemarker

    return frozenset(
        marker.name or name for name, obj in namespace.items() if (marker := getfixturemarker(obj)) is not None
    )


# what a test uses to opt in to the plugin, and so to leaks failing it by default: every fixture of
# fixtures.py, read from it, so a new fixture there opts in without a list to keep up
PLUGIN_FIXTURES = fixtures_of(vars(fixtures))


def _uses_plugin(item: pytest.Item) -> bool:
    """The test uses one of the plugin's markers or fixtures (asked only after a leak)."""
    return any(mark.name in MARKERS for mark in item.iter_markers()) or not PLUGIN_FIXTURES.isdisjoint(
        getattr(item, "fixturenames", ())
    )


def _registration_lint(item: pytest.Item, allow: dict[str, list[str]]) -> Any:
    """Lint marks' keys at registration, against the test's model family when it has one."""
    from pytest_modelpatch.lint.patterns import lint_for_registration

    families = None
    if item.get_closest_marker("model") is not None:
        from pytest_modelpatch.models.specs import config_families

        request = item_model_request(item)
        if request is not None:
            # a composite model's towers are other families' classes: LLaVA runs Llama's, PaliGemma Gemma's
            families = config_families(request.model_spec.config)
    if families is None:
        return lambda mapping, conversions: lint_for_registration(mapping, allow=allow)
    # a family in scope: the contract checks run too, on tiny meta-device models
    from pytest_modelpatch.lint.model_structures import meta_structures

    def lint(mapping: dict[str, type], conversions: dict[str, list[Any]]) -> None:
        keys, swept = list(mapping), patched_sweep_family(item)
        if swept is not None:  # a sweep's key aimed at other families is linted there, not here
            from pytest_modelpatch.models.sweeps import keys_in_family

            keys = [key for key in keys if key in keys_in_family(mapping, swept)]
        kept = {key: kinds for key, kinds in allow.items() if key in keys}
        lint_for_registration(
            {key: mapping[key] for key in keys},
            families=families,
            conversions=conversions,
            allow=kept,
            structures=meta_structures,
        )

    return lint


_TOLERANCE_INI = ("modelpatch_atol", "modelpatch_rtol", "modelpatch_tolerance_policy")
_TOLERANCE_INI_SET = pytest.StashKey[bool]()


def _set_test_tolerance(item: pytest.Item) -> Any:
    config = item.config
    ini_set = config.stash.get(_TOLERANCE_INI_SET, None)
    if ini_set is None:  # read once a session: this runs for every test
        ini_set = config.stash[_TOLERANCE_INI_SET] = any(config.getini(k) for k in _TOLERANCE_INI)
    if not ini_set and "tolerance" not in item.keywords:
        return None
    from pytest_modelpatch.compare._engine.tolerance import ToleranceOverride, set_test_tolerance

    overrides = []
    mark = item.get_closest_marker("tolerance")
    if mark is not None:
        overrides.append(
            ToleranceOverride.from_marker(mark.args, mark.kwargs, f"@pytest.mark.tolerance on {item.nodeid}")
        )
    overrides.append(
        ToleranceOverride.from_ini(
            config.getini("modelpatch_atol"),
            config.getini("modelpatch_rtol"),
            config.getini("modelpatch_tolerance_policy"),
        )
    )
    return set_test_tolerance(*overrides)


def _parallel_backend(item: pytest.Item, spec: ParallelSpec) -> str:
    """gloo on the CPU; nccl on CUDA, with a GPU per rank (else the test skips, or fails under --modelpatch-require-gpu)."""
    requested = item_device(item)
    if not devices.needs_gpu(requested):
        return "gloo"
    resolve_device(item, requested)  # skips without a GPU
    problem = devices.parallel_gpu_problem(spec.world_size, devices.cuda_status())
    if problem is not None:
        if item.config.getoption("modelpatch_require_gpu"):
            pytest.fail(f"{problem}; --modelpatch-require-gpu forbids skipping it", pytrace=False)
        pytest.skip(problem)
    return "nccl"


def pytest_report_header(config: pytest.Config) -> str | None:
    if config.getoption("modelpatch_device") or os.environ.get(devices.DEVICE_ENV):
        return f"modelpatch: default device {devices.requested_device(config.getoption('modelpatch_device'))}"
    return None


# ---------------------------------------------------------------------------
# reports and gates
# ---------------------------------------------------------------------------


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    # set and reset by hand, not in a context manager: one costs every test of the session more than this
    previous = set_record_sink(CheckSink(item))
    try:
        return (yield)
    finally:
        set_record_sink(previous)
