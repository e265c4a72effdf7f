"""Cost of one check_equivalent example against two bare forwards and against a per-example reload.

Three timings, in one run, on the same tiny model and the same drawn inputs. Both models are built
as a pytest session builds them: ``ModelBuilder`` (so the reference enters ``pristine()`` and is
verified around every call, and the patched model counts replacement calls), inside the test's
``ActivePatches``, with the interception wrappers held for the whole run as the plugin holds them
from ``pytest_configure`` (without that hold each ``pristine()`` would install and uninstall them,
a cost no pytest user pays):

- ``check_equivalent``: hypothesis inside one call, models built once (wall time / examples run);
- bare forwards: ``reference(**x)`` and ``patched(**x)`` under ``no_grad`` on exactly the examples
  check_equivalent drew (goal: check_equivalent <= 1.3x this);
- per-example reload: a hand-written ``@given`` test that loads both models with ``from_pretrained``
  in every example and compares logits with ``torch.testing.assert_close``, as such tests are written today.

Printed at the default tiny size users get, and the ratio again at hidden size 256 (intermediate
512), where the forwards weigh more against the check's fixed cost per input.

Then the same paired ratio on every route inputs reach a property check by (``--routes``, on by default):
``check_equivalent``'s default inputs, a user's own strategy (``st.integers(...).map(make_batch)``),
a mapping of strategies (``{"input_ids": strategy}``), and ``check_decodes_equivalent`` against both models'
bare greedy decoding loops on the prompts it drew. Goal: <= 1.3x on each.

Figures are recorded in docs/benchmarks.md ("Property checks"); on a shared
2-core machine compare them only within one run of alternating before/after benches.

Usage::

    python benchmarks/bench_equivalence.py                      # llama_fused_qkv, 50 examples, both sizes
    python benchmarks/bench_equivalence.py --config hidden_size=256,intermediate_size=512,num_hidden_layers=4
    python benchmarks/bench_equivalence.py --patch qwen2_moe --examples 100
    python benchmarks/bench_equivalence.py --routes-only --repeats 7   # the per-route ratios alone
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `fixtures` importable from the repo root
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers.conversion_mapping import register_checkpoint_conversion_mapping
from transformers.monkey_patching import register_patch_mapping

from fixtures import load_patch
from pytest_modelpatch.compare._engine.hints import cache_keyword
from pytest_modelpatch.compare._engine.outputs import compare_outputs
from pytest_modelpatch.compare._engine.property_loop import GROUP_SIZE, input_groups
from pytest_modelpatch.compare._engine.tolerance import resolve_tolerance
from pytest_modelpatch.compare.decoding.equivalence import properties as decoding_properties
from pytest_modelpatch.compare.decoding.properties import check_decodes_equivalent
from pytest_modelpatch.compare.forward.properties import check_equivalent
from pytest_modelpatch.families.strategies import drawn_bytes, model_inputs
from pytest_modelpatch.isolation.guard import builtin_patch_state, isolated_patch_state
from pytest_modelpatch.isolation.interception import hold_for_session
from pytest_modelpatch.isolation.per_test.patch_spec import PatchSpec
from pytest_modelpatch.isolation.registration import ActivePatches
from pytest_modelpatch.models.builder import ModelBuilder, ModelRequest
from pytest_modelpatch.models.checkpoints import load_pretrained


def register(patch: Any) -> None:
    register_patch_mapping(patch.MAPPING)
    for model_type, transforms in patch.CONVERSIONS.items():
        register_checkpoint_conversion_mapping(model_type, transforms, overwrite=True)


def time_check(reference: Any, patched: Any, examples: int, seen: list[Mapping[str, Any]]) -> float:
    """check_equivalent with its default inputs; ``seen`` gets the inputs it compared, each once."""
    seen.clear()
    # the patched model's calls are the inputs compared (a repeat drawn by hypothesis is not)
    handle = patched.register_forward_pre_hook(lambda _m, _a, kwargs: seen.append(dict(kwargs)), with_kwargs=True)
    try:
        start = time.perf_counter()
        report = check_equivalent(reference, patched, max_examples=examples)
        elapsed = time.perf_counter() - start
    finally:
        handle.remove()
    assert len(seen) == report.examples, (len(seen), report.examples)
    return elapsed / report.examples


def time_bare(reference: Any, patched: Any, seen: list[Mapping[str, Any]]) -> float:
    """``.forward`` itself: the plugin's hooks on the root module (pristine scope, usage counts) are not run."""
    start = time.perf_counter()
    with torch.no_grad():
        for example in seen:
            reference.forward(**example)
            patched.forward(**example)
    return (time.perf_counter() - start) / len(seen)


def time_compare(reference: Any, patched: Any, seen: list[Mapping[str, Any]]) -> float:
    """compare_outputs alone, on outputs computed beforehand."""
    spec = resolve_tolerance()
    with torch.no_grad():
        outputs = [(reference(**example), patched(**example)) for example in seen]
    start = time.perf_counter()
    for ours, theirs in outputs:
        compare_outputs(ours, theirs, spec)
    return (time.perf_counter() - start) / len(seen)


def time_draws(config: Any, examples: int) -> float:
    """hypothesis and ``model_inputs`` alone, no models, in groups as check_equivalent draws them: the floor."""
    count = [0]

    drawn = drawn_bytes(model_inputs(config))
    assert drawn is not None

    @settings(
        max_examples=-(-examples // GROUP_SIZE), deadline=None, database=None, suppress_health_check=list(HealthCheck)
    )
    @given(input_groups(drawn))
    def draw_only(raws: list[bytes]) -> None:
        count[0] += len([drawn.build(raw) for raw in raws])

    draw_only._hypothesis_internal_database_key = None  # as check_equivalent skips deriving it (~2 ms a call)
    start = time.perf_counter()
    draw_only()
    return (time.perf_counter() - start) / count[0]


def time_reload(path: Path, patch: Any, examples: int) -> float:
    runs: list[float] = []
    config = load_pretrained(path).config

    @settings(max_examples=examples, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(model_inputs(config))
    def test_patched_matches(inputs: Mapping[str, Any]) -> None:
        start = time.perf_counter()
        with isolated_patch_state():
            register(patch)
            with builtin_patch_state():
                reference = load_pretrained(path)
            patched = load_pretrained(path)
        with torch.no_grad():
            torch.testing.assert_close(patched(**inputs).logits, reference(**inputs).logits)
        runs.append(time.perf_counter() - start)

    start = time.perf_counter()
    test_patched_matches()
    return (time.perf_counter() - start) / len(runs)


# ---------------------------------------------------------------------------
# routes: the ways inputs reach a property check
# ---------------------------------------------------------------------------


def make_ids(config: Any, seed: int) -> torch.Tensor:
    """A batch of 1-3 rows of 1-16 token ids from one integer, as a user's own strategy builds it."""
    generator = torch.Generator().manual_seed(seed)
    batch, length = 1 + seed % 3, 1 + (seed >> 2) % 16
    return torch.randint(config.vocab_size, (batch, length), generator=generator)


def route_inputs(route: str, config: Any) -> Any:
    """What ``inputs=`` gets on each route of ``check_equivalent``."""
    seeds = st.integers(0, 2**31 - 1)
    if route == "default":
        return None
    if route == "strategy":
        return seeds.map(
            lambda seed: {"input_ids": (ids := make_ids(config, seed)), "attention_mask": torch.ones_like(ids)}
        )
    if route == "mapping":
        return {"input_ids": seeds.map(lambda seed: make_ids(config, seed))}
    raise ValueError(route)


def time_route_check(reference: Any, patched: Any, route: str, examples: int, seen: list[Any]) -> float:
    """One property check on ``route``; ``seen`` gets what it ran, each once (inputs, or prompts and token counts)."""
    seen.clear()
    if route == "generation":
        real = decoding_properties.decode_pair

        def spy(ref: Any, pat: Any, prompts: Any, *, max_new_tokens: int, **kwargs: Any) -> Any:
            seen.append((prompts, max_new_tokens))
            return real(ref, pat, prompts, max_new_tokens=max_new_tokens, **kwargs)

        decoding_properties.decode_pair = spy
        try:
            start = time.perf_counter()
            report = check_decodes_equivalent(reference, patched, max_examples=examples)
            elapsed = time.perf_counter() - start
        finally:
            decoding_properties.decode_pair = real
        assert len(seen) == report.examples, (len(seen), report.examples)
        return elapsed / report.examples
    handle = patched.register_forward_pre_hook(lambda _m, _a, kwargs: seen.append(dict(kwargs)), with_kwargs=True)
    try:
        start = time.perf_counter()
        report = check_equivalent(
            reference, patched, inputs=route_inputs(route, reference.config), max_examples=examples
        )
        elapsed = time.perf_counter() - start
    finally:
        handle.remove()
    assert len(seen) == report.examples, (len(seen), report.examples)
    return elapsed / report.examples


def bare_decode(model: Any, prompts: Mapping[str, Any], new_tokens: int) -> None:
    """Greedy decoding with ``.forward`` itself, as check_decodes_equivalent's loop feeds each model: prefill, then a token a step."""
    from transformers import DynamicCache

    cache = {cache_keyword(model): DynamicCache(config=model.config)}
    mask = prompts["attention_mask"]
    positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)
    out = model.forward(
        input_ids=prompts["input_ids"], attention_mask=mask, position_ids=positions, use_cache=True, **cache
    )
    for _ in range(new_tokens - 1):
        tokens = out.logits[:, -1].argmax(-1)[:, None]
        mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=-1)
        positions = positions[:, -1:] + 1
        out = model.forward(input_ids=tokens, attention_mask=mask, position_ids=positions, use_cache=True, **cache)


def time_route_bare(reference: Any, patched: Any, route: str, seen: list[Any]) -> float:
    start = time.perf_counter()
    with torch.no_grad():
        for item in seen:
            if route == "generation":
                bare_decode(reference, *item)
                bare_decode(patched, *item)
            else:
                reference.forward(**item)
                patched.forward(**item)
    return (time.perf_counter() - start) / len(seen)


ROUTES = ("default", "strategy", "mapping", "generation")


def measure_routes(
    builder: ModelBuilder, request: ModelRequest, patch: Any, examples: int, generation_examples: int, repeats: int
) -> dict[str, list[float]]:
    """Paired check/bare ratios per route, the routes interleaved within each round."""
    active = ActivePatches(PatchSpec(mapping=dict(patch.MAPPING), conversions=dict(patch.CONVERSIONS), overwrite=True))
    ratios: dict[str, list[float]] = {route: [] for route in ROUTES}
    try:
        reference, patched = builder.reference(request), builder.patched(request)
        seen: list[Any] = []
        for route in ROUTES:  # warm-up
            try:
                time_route_check(reference, patched, route, 3, seen)
            except AssertionError as error:  # a route this version does not take: reported, not timed
                print(f"route {route}: {str(error).splitlines()[-1]}")
                del ratios[route]
        for _ in range(repeats):
            for route in ratios:
                count = generation_examples if route == "generation" else examples
                check = time_route_check(reference, patched, route, count, seen)
                ratios[route].append(check / time_route_bare(reference, patched, route, seen))
    finally:
        active.close()
    return {route: sorted(values) for route, values in ratios.items()}


LARGER = "hidden_size=256,intermediate_size=512"


def parse_overrides(text: str) -> dict[str, int]:
    return {k: int(v) for k, v in (item.split("=") for item in text.split(",") if item)}


def measure(
    builder: ModelBuilder, request: ModelRequest, patch: Any, examples: int, repeats: int, *, breakdown: bool = True
) -> dict[str, Any]:
    """Interleaved rounds of check and bare forwards (and, with ``breakdown``, draws and comparison alone),
    on models built as a session builds them."""
    # the test's marks, registered as @pytest.mark.patch registers them, open while the check runs
    active = ActivePatches(PatchSpec(mapping=dict(patch.MAPPING), conversions=dict(patch.CONVERSIONS), overwrite=True))
    try:
        reference = builder.reference(request)
        patched = builder.patched(request)
        seen: list[Mapping[str, Any]] = []
        time_check(reference, patched, 5, seen)  # warm-up: first forwards, hypothesis imports
        checks, bares, draws, compares = [], [], [], []
        for _ in range(repeats):  # interleaved: load on a shared machine drifts
            checks.append(time_check(reference, patched, examples, seen))
            bares.append(time_bare(reference, patched, seen))  # one timing each, as the check gets
            if breakdown:
                draws.append(time_draws(reference.config, examples))
                compares.append(time_compare(reference, patched, seen))
    finally:
        active.close()
    measured = {
        "model": type(reference).__name__,
        "check": statistics.median(checks),
        "bare": statistics.median(bares),
        # each check against the bare forwards of its own examples timed just after it: load on a
        # shared machine drifts over seconds, so paired ratios vary far less than either timing
        "ratios": sorted(c / b for c, b in zip(checks, bares)),
    }
    if breakdown:
        measured["draw"], measured["compare"] = statistics.median(draws), statistics.median(compares)
        # per round, then the median: a difference of medians taken apart goes negative on a noisy machine
        measured["rest"] = statistics.median(c - b - d - m for c, b, d, m in zip(checks, bares, draws, compares))
    return measured


def ratio_text(measured: dict[str, Any], note: str = "") -> str:
    ratios = measured["ratios"]
    spread = f"{ratios[0]:.2f}x-{ratios[-1]:.2f}x{note}"
    return f"check/bare = {statistics.median(ratios):.2f}x median of {len(ratios)} paired runs ({spread})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--patch", default="llama_fused_qkv", help="example patch under fixtures/patches")
    parser.add_argument("--examples", type=int, default=50, help="check_equivalent examples")
    parser.add_argument("--reload-examples", type=int, default=5, help="examples for the per-example reload test")
    parser.add_argument("--repeats", type=int, default=21)
    parser.add_argument("--route-examples", type=int, default=60, help="examples per check on each route")
    parser.add_argument("--generation-examples", type=int, default=10, help="check_decodes_equivalent examples")
    parser.add_argument("--no-routes", action="store_true", help="skip the per-route ratios")
    parser.add_argument("--routes-only", action="store_true", help="only the per-route ratios")
    parser.add_argument(
        "--config", default="", metavar="K=V,...",
        help="tiny-config overrides, e.g. hidden_size=256,intermediate_size=512,num_hidden_layers=4, measured "
        f"instead of the default size (and {LARGER}, which is measured too when this is not given)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    torch.set_num_threads(1)

    patch = load_patch(args.patch)
    hold_for_session(True)  # as the plugin does from pytest_configure to pytest_unconfigure
    with tempfile.TemporaryDirectory() as tmp:
        builder = ModelBuilder(Path(tmp))
        request = ModelRequest(patch.MODEL_TYPE, parse_overrides(args.config))
        routes = None
        if not args.no_routes:
            routes = measure_routes(
                builder, request, patch, args.route_examples, args.generation_examples, args.repeats
            )
        if args.routes_only:
            hold_for_session(False)
            print_routes(routes or {}, args)
            return 0
        measured = measure(builder, request, patch, args.examples, args.repeats)
        larger = None
        if not args.config:  # the same check on a wider model: hypothesis' fixed cost per input weighs less
            larger_request = ModelRequest(patch.MODEL_TYPE, parse_overrides(LARGER))
            larger = measure(builder, larger_request, patch, args.examples, args.repeats, breakdown=False)
        reload = time_reload(builder.checkpoint(request), patch, args.reload_examples)
    hold_for_session(False)

    check = measured["check"]
    print(
        f"model: {measured['model']} ({args.patch}{', ' + args.config if args.config else ''}), "
        f"{args.examples} examples, median of {args.repeats} interleaved runs"
    )
    print(f"check_equivalent        {check * 1e3:8.2f} ms/example")
    print(
        f"two bare forwards        {measured['bare'] * 1e3:8.2f} ms/example   {ratio_text(measured, '; goal <= 1.3x')}"
    )
    print(f"  drawing inputs         {measured['draw'] * 1e3:8.2f} ms/example   (hypothesis + model_inputs, no models)")
    print(f"  comparing outputs      {measured['compare'] * 1e3:8.2f} ms/example   (compare_outputs alone)")
    print(
        f"  the rest               {measured['rest'] * 1e3:8.2f} ms/example   (hypothesis running the test, cache effects)"
    )
    print(f"reload per example       {reload * 1e3:8.2f} ms/example   reload/check = {reload / check:.1f}x")
    if larger is not None:
        print(
            f"at {LARGER}: check {larger['check'] * 1e3:.2f} ms/example, two bare forwards "
            f"{larger['bare'] * 1e3:.2f} ms/example, {ratio_text(larger)}"
        )
    if routes is not None:
        print_routes(routes, args)
    return 0


def print_routes(routes: dict[str, list[float]], args: argparse.Namespace) -> None:
    print(f"routes: check/bare, median of {args.repeats} paired runs (goal <= 1.3x each)")
    for route, ratios in routes.items():
        count = args.generation_examples if route == "generation" else args.route_examples
        print(f"  {route:<12} {statistics.median(ratios):.2f}x ({ratios[0]:.2f}x-{ratios[-1]:.2f}x), {count} examples")


if __name__ == "__main__":
    raise SystemExit(main())
