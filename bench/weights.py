"""Weight formats side by side (the README's `--weights` table and docs/weights.md): SmolLM2
exported with each weight format and its default KV cache (fp32 and int8 weights: fp32; fp16 /
bf16 weights: the same 16-bit format), plus fp16 / bf16 weights with an fp32 cache and int8
weights with an fp16 one, at batch 1 and 8; decode measured in one `nxdc bench` run
(round-robin, same process), accuracy against fp32 on the fixed text.

    .venv/bin/python bench/weights.py [--new-tokens 96] [--runs 3]

Writes docs/bench-weights.json and prints a Markdown table."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
CONFIGS = [  # (weights, KV cache): the defaults first
    ("fp32", "fp32"),
    ("fp16", "fp16"),
    ("bf16", "bf16"),
    ("int8", "fp32"),
    ("fp16", "fp32"),
    ("bf16", "fp32"),
    ("int8", "fp16"),
]


def label(w: str, kv: str) -> str:
    return f"{w}-kv{kv}"


def default_kv(w: str) -> str:
    """The KV cache an export with ``--weights w`` gets by default."""
    from nxdc.plan import stored_kv_cache

    return stored_kv_cache(None, w, "fp32") or "fp32"


def export_dir(w: str, kv: str, batch: int) -> Path:
    """Where this script keeps the export with weights ``w``, KV cache ``kv`` at one batch size."""
    return ROOT / "bench" / "exports" / f"weights-{label(w, kv)}-b{batch}"


def export(w: str, kv: str, batch: int) -> Path:
    """SmolLM2 with weights ``w`` and KV cache ``kv`` at one batch size in export_dir (compiled
    on the first call, a cache hit after)."""
    from nxdc.pipeline import run_export
    from nxdc.plan import ExportOptions

    d = export_dir(w, kv, batch)
    opts = ExportOptions(
        batch_size=batch, sequence_length=256, context_buckets=(128,), weights=w, kv_cache=kv
    )
    run_export("smollm2-135m", d, opts)
    return d


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--batch-sizes", default="1,8")
    args = ap.parse_args()

    from nxdc.accuracy import measure_formats
    from nxdc.bench.runner import run_bench
    from nxdc.plan import ExportOptions

    batches = [int(b) for b in args.batch_sizes.split(",")]
    dirs = {(label(w, kv), b): export(w, kv, b) for w, kv in CONFIGS for b in batches}
    acc = {}
    for kv in sorted({kv for _, kv in CONFIGS}):
        fmts = [w for w, k in CONFIGS if k == kv and (w, k) != ("fp32", "fp32")]
        opts = ExportOptions(sequence_length=512, kv_cache=kv)
        acc.update({label(r["weights"], kv): r for r in measure_formats("smollm2-135m", opts, fmts)})
    res = run_bench(
        list(dirs.values()),
        prompt_lengths=[128],
        new_tokens=args.new_tokens,
        runs=args.runs,
        progress=lambda m: print(m, file=sys.stderr),
    )
    rate = {}
    for row, key in zip(res["rows"], dirs, strict=True):
        row["export"] = str(Path(row["export"]).resolve().relative_to(ROOT))  # the same in every clone
        rate[key] = row
    out = {"machine": res["machine"], "accuracy": acc, "rows": {f"{c}-b{b}": r for (c, b), r in rate.items()}}
    (ROOT / "docs" / "bench-weights.json").write_text(json.dumps(out, indent=1))
    b1, b8 = batches[0], batches[-1]
    print(
        f"| weights | KV cache | file MB | decode tok/s b{b1} | roofline b{b1} (paired) | tok/s b{b8} | b{b8} ÷ b{b1} | top-1 vs fp32 | perplexity Δ | max logit err |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for w, kv in CONFIGS:
        c = label(w, kv)
        r1, r8 = rate[(c, b1)], rate[(c, b8)]
        mb = (dirs[(c, b1)] / "weights" / "rank0.safetensors").stat().st_size / 1e6
        a = acc.get(c)
        accs = (
            f"{a['top1_agreement']:.1%} | {a['perplexity_ratio'] - 1:+.2%} | {a['max_abs_logit_error']:.3g}"
            if a
            else "– | – | –"
        )
        print(
            f"| {w} | {kv}{' (default)' if default_kv(w) == kv else ''} | {mb:.0f} | {r1['decode_tokens_per_s']:.1f} | {r1['fraction_of_read_roofline']:.0%} ({r1['fraction_of_read_roofline_paired']:.0%}) | {r8['decode_tokens_per_s']:.1f} | "
            f"{r8['decode_tokens_per_s'] / r1['decode_tokens_per_s']:.1f}× | {accs} |"
        )


if __name__ == "__main__":
    main()
