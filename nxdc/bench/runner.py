"""Run benchmark configurations over one or more export directories.

Per (export, batch, prompt length): warm-up runs excluded, medians over runs for TTFT,
decode tokens/s, end-to-end latency and prefill tokens/s; inter-token latency percentiles
over every step of every run; bytes read per decode step and the share of the measured
read-bandwidth roofline (the ceiling: the best read bandwidth measured before and after each of
this configuration's runs, because a shared machine's bandwidth drifts by tens of percent between
minutes; and, paired, each run against the samples just before and after it); optionally transformers' eager generate on the same weights and
token ids, interleaved run by run (ratios, because shared machines drift)."""

from __future__ import annotations

import contextlib
import statistics
from collections.abc import Callable
from pathlib import Path

import numpy as np

from nxdc.bench.machine import machine_info, peak_rss_mib
from nxdc.errors import UserInputError

SCHEMA = 1


def synthetic_prompt(tokenizer, n: int) -> list[int]:
    """``n`` token ids of ordinary text (repeated as needed), the same for every system."""
    text = " ".join(["The quick brown fox jumps over the lazy dog while the compiler caches graphs."] * 8)
    ids = list(tokenizer(text)["input_ids"]) or [0]
    return (ids * (n // len(ids) + 1))[:n]


def step_bytes(session, position: int) -> int:
    """Bytes a decode step at ``position`` must read: every weight once plus the KV cache slots
    up to that position (what attention needs; nxdc's CPU attention kernel reads no more)."""
    from nxdc.plan import kv_cache_bytes, weight_bytes

    s, p = session.spec, session.plan
    return weight_bytes(s, p) + kv_cache_bytes(s, p, position + 1)


def run_bench(
    export_dirs: list[Path],
    batch_sizes: list[int] | None = None,
    prompt_lengths: list[int] = (128,),
    new_tokens: int = 128,
    runs: int = 3,
    warmup: int = 1,
    compare: str | None = None,
    threads: int | None = None,
    progress: Callable[[str], None] | None = None,
) -> dict:
    from nxdc.runtime.threads import apply_threads
    from nxdc.runtime.workers import open_session

    if runs < 1 or warmup < 0 or new_tokens < 2:
        raise UserInputError("--runs must be >= 1, --warmup >= 0 and --new-tokens >= 2")
    if compare not in (None, "transformers"):
        raise UserInputError(f"--compare takes 'transformers' (got {compare!r})")
    asked_threads = threads  # tp > 1 exports split the cores over ranks unless told otherwise
    threads = apply_threads(threads)
    info = machine_info(threads)
    rows = []
    for d in export_dirs:
        with contextlib.closing(open_session(d, threads=asked_threads)) as sess:
            rows += _bench_export(
                sess, d, batch_sizes, prompt_lengths, new_tokens, runs, warmup, compare, progress, info
            )
    return {"schema": SCHEMA, "machine": info, "rows": rows}


def _bench_export(sess, d, batch_sizes, prompt_lengths, new_tokens, runs, warmup, compare, progress, info):
    from nxdc.cli.generate import load_tokenizer
    from nxdc.generation.loop import generate

    rows = []
    tok = load_tokenizer(d)
    ref = None
    if compare:
        from nxdc.bench.reference import transformers_model

        ref = transformers_model(Path(d), sess.manifest)
    for b in batch_sizes or [sess.batch_size]:
        if b > sess.batch_size:
            raise UserInputError(f"{d}: batch {b} exceeds the export's batch size {sess.batch_size}")
        for length in prompt_lengths:
            if length + new_tokens > sess.max_seq:
                raise UserInputError(
                    f"{d}: prompt {length} + {new_tokens} new tokens exceeds the sequence length {sess.max_seq}"
                )
            sess.context_bucket(length)  # clear error if no bucket holds it
            if progress:
                progress(f"{Path(d).name}: batch {b}, prompt {length}")
            ids = [synthetic_prompt(tok, length)] * b
            rows.append(_measure(sess, tok, ids, new_tokens, runs, warmup, ref, generate, d, info["threads"]))
    return rows


def _measure(sess, tok, ids, new_tokens, runs, warmup, ref, generate, export_dir, threads: int) -> dict:
    from nxdc.bench.machine import read_bandwidth_gbs
    from nxdc.bench.reference import transformers_generate

    b, length = len(ids), len(ids[0])
    for _ in range(warmup):
        generate(sess, tok, [""] * b, new_tokens, eos_ids=set(), prompt_ids=ids)
        if ref is not None:
            transformers_generate(ref, ids, 4)
    ours, theirs, itl = [], [], []

    def sample() -> float:  # the read ceiling of the device the export runs on
        return read_bandwidth_gbs(threads, reps=3, device=sess.device)

    bandwidth = [sample()]  # around every run: the ceiling is the best
    for _ in range(runs):
        res = generate(sess, tok, [""] * b, new_tokens, eos_ids=set(), prompt_ids=ids)
        ours.append(res)
        itl += res.inter_token_s
        bandwidth.append(sample())
        if ref is not None:
            theirs.append(transformers_generate(ref, ids, new_tokens))
    med = statistics.median
    decode_tps = med(r.decode_tokens_per_s for r in ours)
    ttft = med(r.ttft_s for r in ours)
    nbytes = step_bytes(sess, length + new_tokens // 2)  # the typical step of the run
    row = {
        "export": str(export_dir),
        "batch": b,
        "export_batch_size": sess.batch_size,
        "prompt_tokens": length,
        "new_tokens": new_tokens,
        "runs": len(ours),
        "ttft_ms": ttft * 1000,
        "itl_ms": {q: float(np.percentile(itl, int(q[1:])) * 1000) for q in ("p50", "p90", "p99")},
        "decode_tokens_per_s": decode_tps,
        "e2e_ms": med(r.total_s for r in ours) * 1000,
        "prefill_tokens_per_s": b * length / ttft,
        "peak_rss_mib": peak_rss_mib(),
        "bytes_per_decode_step": nbytes,
        "huge_page_fraction": _huge_page_fraction(sess),
    }
    steps_per_s = 1.0 / row["itl_ms"]["p50"] * 1000
    row["read_gbs_achieved"] = steps_per_s * nbytes / 1e9
    row["read_bandwidth_gbs"] = max(bandwidth)
    row["fraction_of_read_roofline"] = row["read_gbs_achieved"] / row["read_bandwidth_gbs"]
    # Paired: each run against the better of the two samples taken just before and after it, then
    # the median over runs. On a host whose read rate moves between minutes, this compares a run
    # with the machine it ran on; the figure above compares the typical step with the best moment.
    row["fraction_of_read_roofline_paired"] = med(
        nbytes / float(np.median(r.inter_token_s)) / 1e9 / max(bandwidth[i], bandwidth[i + 1])
        for i, r in enumerate(ours)
    )
    if theirs:
        t = {
            "ttft_ms": med(x["ttft_s"] for x in theirs) * 1000,
            "decode_tokens_per_s": med(x["decode_tokens_per_s"] for x in theirs),
            "e2e_ms": med(x["e2e_s"] for x in theirs) * 1000,
        }
        row["transformers"] = t
        row["ratio_vs_transformers"] = {
            "decode_tokens_per_s": decode_tps / t["decode_tokens_per_s"],
            "ttft": row["ttft_ms"] / t["ttft_ms"],
            "e2e": row["e2e_ms"] / t["e2e_ms"],
        }
    return row


def _huge_page_fraction(sess) -> float | None:
    """Share of the (rank 0) weights + KV cache the kernel backs with huge pages; None off the host."""
    arena = sess.arena
    return arena.huge_bytes() / arena.size if arena is not None else None
