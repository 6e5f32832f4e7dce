"""Decode/TTFT benchmark: nxdc vs Hugging Face transformers eager, interleaved in one run.

Usage (from a checkout after `make install`):
    .venv/bin/python bench/decode.py [--batch-sizes 1,4] [--prompt-tokens 128] [--new-tokens 128] [--runs 3]

Exports SmolLM2-135M (fp32) once per batch size into bench/exports/ (through the normal compile
cache), then for each run measures, for nxdc and transformers on the same prompt token ids:
TTFT (prefill + first token) and decode tokens/s (tokens after the first, summed over the
batch). Also measures the machine's memory copy bandwidth and reports the fraction of the
bandwidth roofline (weight + KV bytes read per decode step / bandwidth) that nxdc reaches.
Prints a markdown table and writes bench/results/decode.json."""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

HERE = Path(__file__).parent


def copy_bandwidth_gbs(threads: int, mib: int = 512, reps: int = 10) -> float:
    """Read+write bytes per second of a large fp32 tensor copy (the STREAM 'copy' convention)."""
    torch.set_num_threads(threads)
    a = torch.ones(mib * 2**20 // 4)
    b = torch.empty_like(a)
    b.copy_(a)
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        b.copy_(a)
        best = min(best, time.perf_counter() - t)
    return 2 * a.numel() * 4 / best / 1e9


def read_bandwidth_gbs(threads: int, mib: int = 512, reps: int = 10) -> float:
    """Bytes per second of a large fp32 reduction (read only: what a matvec does)."""
    torch.set_num_threads(threads)
    a = torch.ones(mib * 2**20 // 4)
    a.sum()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        a.sum()
        best = min(best, time.perf_counter() - t)
    return a.numel() * 4 / best / 1e9


def ensure_export(batch: int, seq: int) -> Path:
    from nxdc.export import run_export
    from nxdc.plan import ExportOptions

    out = HERE / "exports" / f"smollm2-b{batch}-s{seq}"
    # always re-export: a cache hit costs seconds and guarantees the export matches this code
    run_export(
        "smollm2-135m", out, ExportOptions(batch_size=batch, sequence_length=seq, context_buckets=(128, 512))
    )
    return out


def prompt_ids(tok, n: int) -> list[int]:
    text = " ".join(["The quick brown fox jumps over the lazy dog."] * 64)
    ids = tok(text)["input_ids"][:n]
    assert len(ids) == n
    return ids


def bench_nxdc(sess, tok, ids: list[list[int]], new_tokens: int) -> tuple[float, float]:
    from nxdc.generation.loop import generate

    res = generate(sess, tok, ["" for _ in ids], max_new_tokens=new_tokens, eos_ids=set(), prompt_ids=ids)
    return res.ttft_s, res.decode_tokens_per_s


def bench_hf(model, ids: list[list[int]], new_tokens: int) -> tuple[float, float]:
    x = torch.tensor(ids)
    kw = dict(attention_mask=torch.ones_like(x), do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.no_grad():
        t = time.perf_counter()
        model.generate(x, max_new_tokens=1, min_new_tokens=1, **kw)
        ttft = time.perf_counter() - t
        t = time.perf_counter()
        model.generate(x, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **kw)
        total = time.perf_counter() - t
    return ttft, (new_tokens - 1) * len(ids) / max(total - ttft, 1e-9)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch-sizes", default="1,4")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--sequence-length", type=int, default=1024)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--no-hf", action="store_true")
    args = ap.parse_args()

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from nxdc.runtime.session import Session
    from nxdc.runtime.threads import apply_threads
    from nxdc.weights.sources import embedded_path

    threads = apply_threads(args.threads)
    bw_copy, bw_read = copy_bandwidth_gbs(threads), read_bandwidth_gbs(threads)
    torch.set_num_threads(threads)
    p = embedded_path("smollm2-135m")
    tok = AutoTokenizer.from_pretrained(p.parent, gguf_file=p.name)
    hf = (
        None
        if args.no_hf
        else AutoModelForCausalLM.from_pretrained(p.parent, gguf_file=p.name, dtype=torch.float32).eval()
    )
    rows = []
    for batch in [int(b) for b in args.batch_sizes.split(",")]:
        sess = Session(ensure_export(batch, args.sequence_length), threads=threads)
        ids = [prompt_ids(tok, args.prompt_tokens)] * batch
        spec, plan = sess.spec, sess.plan
        kv_read = 2 * spec.num_layers * batch * spec.num_kv_heads * plan.sequence_length * spec.head_dim * 4
        step_bytes = spec.param_count() * 4 + kv_read
        bench_nxdc(sess, tok, ids, 8)  # warm-up
        if hf is not None:
            bench_hf(hf, ids, 4)
        n_ttft, n_tps, h_ttft, h_tps = [], [], [], []
        for _ in range(args.runs):
            a, b = bench_nxdc(sess, tok, ids, args.new_tokens)
            n_ttft.append(a)
            n_tps.append(b)
            if hf is not None:
                a, b = bench_hf(hf, ids, args.new_tokens)
                h_ttft.append(a)
                h_tps.append(b)
        med = statistics.median
        steps_per_s = med(n_tps) / batch
        row = {
            "batch": batch,
            "prompt_tokens": args.prompt_tokens,
            "new_tokens": args.new_tokens,
            "nxdc_ttft_ms": med(n_ttft) * 1000,
            "nxdc_decode_tok_s": med(n_tps),
            "hf_ttft_ms": med(h_ttft) * 1000 if h_ttft else None,
            "hf_decode_tok_s": med(h_tps) if h_tps else None,
            "bytes_per_step": step_bytes,
            "roofline_steps_s_read_bw": bw_read * 1e9 / step_bytes,
            "fraction_of_read_roofline": steps_per_s * step_bytes / (bw_read * 1e9),
        }
        rows.append(row)
        del sess
    result = {
        "machine": {
            "cpu": platform.processor() or platform.machine(),
            "threads": threads,
            "isa": torch.backends.cpu.get_cpu_capability(),
            "torch": torch.__version__,
            "copy_bandwidth_gbs": bw_copy,
            "read_bandwidth_gbs": bw_read,
        },
        "rows": rows,
    }
    (HERE / "results").mkdir(exist_ok=True)
    (HERE / "results" / "decode.json").write_text(json.dumps(result, indent=2))
    print(
        f"threads {threads}, copy bandwidth {bw_copy:.1f} GB/s (read+write), read bandwidth {bw_read:.1f} GB/s"
    )
    print(
        "| batch | nxdc TTFT ms | HF TTFT ms | nxdc decode tok/s | HF decode tok/s | speed-up | % of read roofline |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        hf_t = f"{r['hf_ttft_ms']:.0f}" if r["hf_ttft_ms"] else "-"
        hf_d = f"{r['hf_decode_tok_s']:.1f}" if r["hf_decode_tok_s"] else "-"
        sp = f"{r['nxdc_decode_tok_s'] / r['hf_decode_tok_s']:.2f}x" if r["hf_decode_tok_s"] else "-"
        print(
            f"| {r['batch']} | {r['nxdc_ttft_ms']:.0f} | {hf_t} | {r['nxdc_decode_tok_s']:.1f} | {hf_d} | {sp} | "
            f"{100 * r['fraction_of_read_roofline']:.0f}% |"
        )


if __name__ == "__main__":
    main()
