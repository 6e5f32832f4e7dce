"""The two ceilings of a CPU decode step, measured on this machine, and the batch-8 / batch-1
throughput ratio they allow per weight format: a step must read every weight once (read
bandwidth) and do one fp32 multiply-add per weight and sequence (FMA peak: activations and
accumulation stay fp32 whatever `--weights` stores).

    .venv/bin/python bench/ceilings.py [EXPORT ...] [--batch 8] [--threads 2] [--read-gbs R]

EXPORT defaults to bench/weights.py's batch-1 exports with an fp32 KV cache. The FMA peak comes from
bench/fma_peak.c (built here with gcc), the read rate from the bench's own sample
(`nxdc.bench.machine.read_bandwidth_gbs`). With docs/bench-weights.json present, the last
columns use the measured batch-1 step (its ITL p50) instead of the read floor. The batch-N floor
counts the weights' FMAs only: no attention, no weight conversion, no other work."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def fma_peak_gflops(threads: int) -> float:
    """Best fp32 FMA rate on ``threads`` threads, either vector width (GFLOP/s, 2 per FMA)."""
    with tempfile.TemporaryDirectory() as tmp:
        exe = Path(tmp) / "fma_peak"
        try:
            subprocess.run(
                ["gcc", "-O3", "-fopenmp", str(ROOT / "bench" / "fma_peak.c"), "-o", str(exe)], check=True
            )
        except (OSError, subprocess.CalledProcessError) as e:
            sys.exit(f"error: could not build bench/fma_peak.c with gcc: {e}")
        run = subprocess.run([str(exe), str(threads)], capture_output=True, text=True)
        if run.returncode != 0:
            sys.exit(f"error: bench/fma_peak.c: {run.stderr.strip()}")
        out = run.stdout
    rates = [float(g) for bits, t, g in (line.split() for line in out.splitlines()) if int(t) == threads]
    return max(rates)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("exports", nargs="*", type=Path)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--read-gbs", type=float, help="use this read rate instead of sampling one")
    args = ap.parse_args()

    from weights import export_dir  # bench/weights.py: its exports

    from nxdc.bench.machine import read_bandwidth_gbs
    from nxdc.compile.trace import weight_bytes
    from nxdc.manifest import load_manifest

    exports = args.exports or [export_dir(w, "fp32", 1) for w in ("fp32", "fp16", "bf16", "int8")]
    missing = [str(d) for d in exports if not (d / "nxdc.json").is_file()]
    if missing:
        sys.exit(f"error: no export at {', '.join(missing)}: run bench/weights.py or pass export directories")
    measured = {}  # batch-1 rows of the checked-in bench/weights.py run, by export directory
    bench_json = ROOT / "docs" / "bench-weights.json"
    if bench_json.exists():
        rows = json.loads(bench_json.read_text())["rows"].values()
        measured = {(ROOT / r["export"]).resolve(): r for r in rows if r["batch"] == 1}
    peak = fma_peak_gflops(args.threads)
    bw = args.read_gbs or read_bandwidth_gbs(args.threads)
    print(f"FMA peak {peak:.1f} GFLOP/s, read {bw:.1f} GB/s, {args.threads} threads", file=sys.stderr)
    b = args.batch
    print(
        f"| weights | MB read | GFLOP per token | batch 1 floor ms | batch {b} floor ms (FMA) | "
        f"ceiling of b{b} ÷ b1 | measured b1 ms | ceiling of b{b} ÷ b1 at the measured b1 |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for d in exports:
        m = load_manifest(d)
        spec, plan = m.spec, m.plan
        nbytes = weight_bytes(spec, plan)
        macs = spec.param_count(active=True) - (
            0 if spec.tie_word_embeddings else spec.vocab_size * spec.hidden_size
        )
        t1 = nbytes / bw / 1e9 * 1e3
        fma = b * 2 * macs / peak / 1e9 * 1e3
        tb = max(t1, fma)
        fmt = plan.weight_format
        row = measured.get(Path(d).resolve())
        t1m = row["itl_ms"]["p50"] if row else None
        tail = f"{t1m:.2f} | {b * t1m / tb:.1f}× |" if t1m else "– | – |"
        print(
            f"| {fmt} | {nbytes / 1e6:.0f} | {2 * macs / 1e9:.3f} | {t1:.2f} | {tb:.2f} ({fma:.2f}) | "
            f"{b * t1 / tb:.1f}× | {tail}"
        )


if __name__ == "__main__":
    main()
