"""Cost of assert_roundtrip against transformers' own load + save of the same checkpoint.

Writes a seeded fp32 Llama of about 280 MB in three shards, registers the fused-QKV
example patch, and runs each measurement in a fresh subprocess:

- baseline: ``from_pretrained`` + ``save_pretrained`` (what any user of the patch pays);
- check: ``assert_roundtrip`` (load, save, streaming diff, unpatched reload + outputs);
- weights-only: ``assert_roundtrip(check_outputs=False)``.

Peak memory is the child's ``VmHWM`` minus its RSS after importing torch and transformers,
so import overhead does not count. Goals: time <= 1.2x baseline, peak <= 1.2x (model size +
largest shard).

Usage: ``python benchmarks/bench_roundtrip.py [--repeats 2] [--keep DIR]``
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONFIG = dict(
    vocab_size=16000,
    hidden_size=1024,
    intermediate_size=2048,
    num_hidden_layers=4,
    num_attention_heads=16,
    num_key_value_heads=8,
    tie_word_embeddings=False,
)


def _proc_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def child(mode: str, source: str, work: str) -> None:
    """Run one measurement in this (fresh) process; print a JSON line."""
    import torch

    torch.set_num_threads(1)
    import transformers
    from transformers.conversion_mapping import register_checkpoint_conversion_mapping
    from transformers.monkey_patching import register_patch_mapping

    from fixtures.patches import llama_fused_qkv
    from pytest_modelpatch.roundtrip.check import assert_roundtrip

    register_patch_mapping(llama_fused_qkv.MAPPING)
    for key, transforms in llama_fused_qkv.CONVERSIONS.items():
        register_checkpoint_conversion_mapping(key, transforms, overwrite=True)
    rss_after_import = _proc_kib("VmRSS")
    started = time.perf_counter()
    if mode == "baseline":
        model = transformers.LlamaForCausalLM.from_pretrained(source, dtype="auto")
        model.save_pretrained(work)
    else:
        report = assert_roundtrip(source, tmp_path=work, check_outputs=(mode == "check"))
        assert report.passed, str(report)
    elapsed = time.perf_counter() - started
    peak = _proc_kib("VmHWM")
    print(json.dumps({"seconds": elapsed, "peak_delta_bytes": (peak - rss_after_import) * 1024}))


def measure(mode: str, source: Path, scratch: Path) -> dict[str, float]:
    work = tempfile.mkdtemp(dir=scratch, prefix=f"{mode}-")
    out = subprocess.run(
        [sys.executable, __file__, "--child", mode, str(source), work],
        check=True,
        capture_output=True,
        text=True,
        cwd=REPO,
        env={"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin", "TQDM_DISABLE": "1"},
    )
    subprocess.run(["rm", "-rf", work], check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def write_source(path: Path) -> None:
    import torch

    torch.set_num_threads(1)
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**CONFIG)).save_pretrained(path, max_shard_size="100MB")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--keep", type=Path, help="write the checkpoint here and keep it")
    parser.add_argument("--child", nargs=3, metavar=("MODE", "SOURCE", "WORK"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        sys.path.insert(0, str(REPO))
        child(*args.child)
        return

    with tempfile.TemporaryDirectory(prefix="bench-roundtrip-") as tmp:
        scratch = Path(tmp)
        source = args.keep or scratch / "source"
        if not (source / "config.json").exists():
            write_source(source)
        shards = sorted(source.glob("*.safetensors"))
        model_bytes = sum(p.stat().st_size for p in shards)
        largest = max(p.stat().st_size for p in shards)
        print(f"checkpoint: {model_bytes / 1e6:.0f} MB in {len(shards)} shards (largest {largest / 1e6:.0f} MB)")
        results: dict[str, dict[str, float]] = {}
        for mode in ("baseline", "check", "weights-only"):
            runs = [measure(mode, source, scratch) for _ in range(args.repeats)]
            results[mode] = {
                "seconds": min(r["seconds"] for r in runs),
                "peak_delta_bytes": max(r["peak_delta_bytes"] for r in runs),
            }
            print(
                f"{mode:>12}: {results[mode]['seconds']:.2f} s, peak +{results[mode]['peak_delta_bytes'] / 1e6:.0f} MB"
            )
        budget = model_bytes + largest
        base = results["baseline"]
        for mode in ("check", "weights-only"):
            row = results[mode]
            print(
                f"{mode:>12}: time {row['seconds'] / base['seconds']:.2f}x baseline (goal <= 1.2x); "
                f"peak {row['peak_delta_bytes'] / budget:.2f}x model+largest shard (goal <= 1.2x; "
                f"baseline {base['peak_delta_bytes'] / budget:.2f}x)"
            )


if __name__ == "__main__":
    main()
