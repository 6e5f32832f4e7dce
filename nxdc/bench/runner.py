"""Run benchmark configurations over one or more export directories.

Per (export, batch, prompt length): warm-up runs excluded, medians over runs for TTFT,
decode tokens/s, end-to-end latency and prefill tokens/s; inter-token latency percentiles
over every step of every run; bytes read per decode step and the share of the measured
read-bandwidth roofline (the ceiling: the best read bandwidth measured just before and after
each of this configuration's runs, because a shared machine's bandwidth drifts by tens of
percent between minutes; and, paired, each run against its own two samples). Every tp 1
export stays loaded and their configurations run round-robin, one run each per round, so that
drift hits them alike (an export at tp > 1 runs alone: one process group per process); transformers' eager generate on the same weights and token ids (``--compare``) runs
right after each nxdc run. Ratios, because shared machines drift."""

from __future__ import annotations

import contextlib
import statistics
from collections.abc import Callable
from pathlib import Path

import numpy as np

from nxdc.bench.machine import (
    machine_info,
    peak_rss_mib,
    read_bandwidth_gbs,
    read_buffers_mib,
    reset_peak_rss,
)
from nxdc.bench.reference import transformers_generate, transformers_model
from nxdc.buckets import pick_context_bucket
from nxdc.compile.trace import weight_bytes
from nxdc.errors import UserInputError
from nxdc.generation.loop import generate
from nxdc.manifest import load_manifest
from nxdc.plan import kv_cache_bytes
from nxdc.runtime.threads import apply_threads
from nxdc.runtime.tokenizer import load_tokenizer
from nxdc.runtime.workers import open_runner

SCHEMA = 1


def synthetic_prompt(tokenizer, n: int) -> list[int]:
    """``n`` token ids of ordinary text (repeated as needed), the same for every system."""
    text = " ".join(["The quick brown fox jumps over the lazy dog while the compiler caches graphs."] * 8)
    ids = list(tokenizer(text)["input_ids"]) or [0]
    return (ids * (n // len(ids) + 1))[:n]


def step_bytes(session, position: int) -> int:
    """Bytes a decode step at ``position`` must read: every weight once plus the KV cache slots
    up to that position (what attention needs; nxdc's CPU attention kernel reads no more)."""

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

    if runs < 1 or warmup < 0 or new_tokens < 2:
        raise UserInputError("--runs must be >= 1, --warmup >= 0 and --new-tokens >= 2")
    if compare not in (None, "transformers"):
        raise UserInputError(f"--compare takes 'transformers' (got {compare!r})")
    asked_threads = threads  # tp > 1 exports split the cores over ranks unless told otherwise
    threads = apply_threads(threads)
    info = machine_info(threads)
    reset_peak_rss()  # the peak from here on: loading and running (and the read buffer kept)
    # torch.distributed allows one process group per process: exports at tp > 1 run one at a time,
    # every tp 1 export together.
    tps = [load_manifest(d).plan.tp for d in export_dirs]
    groups = [[i for i, tp in enumerate(tps) if tp == 1]] + [[i] for i, tp in enumerate(tps) if tp > 1]
    by_export: dict[int, list[dict]] = {}
    for group in groups:
        with contextlib.ExitStack() as stack:
            configs: list[_Config] = []
            for i in group:
                sess = stack.enter_context(open_runner(export_dirs[i], threads=asked_threads))
                configs += _configs(
                    sess, export_dirs[i], i, batch_sizes, prompt_lengths, new_tokens, compare, info
                )
            _round_robin(configs, runs, warmup, progress)
            for c in configs:
                by_export.setdefault(c.index, []).append(c.row())
    rows = [row for i in range(len(export_dirs)) for row in by_export.get(i, [])]
    return {"schema": SCHEMA, "machine": info, "rows": rows}


def _round_robin(configs: list[_Config], runs: int, warmup: int, progress) -> None:
    """Warm every configuration, then run each once per round: a host that drifts between
    minutes then shifts all of them alike, and their ratios (batch 8 / batch 1, one export /
    another) hold."""
    for c in configs:
        if progress:
            progress(f"{c.label}: warm-up")
        c.warm(warmup)
    for r in range(runs):
        for c in configs:
            if progress:
                progress(f"{c.label}: run {r + 1}/{runs}")
            c.run_once()


def _configs(sess, d, index, batch_sizes, prompt_lengths, new_tokens, compare, info) -> list[_Config]:

    tok = load_tokenizer(d)
    ref = None
    if compare:
        ref = transformers_model(Path(d), sess.manifest)
    out = []
    for b in batch_sizes or [sess.batch_size]:
        if b > sess.batch_size:
            raise UserInputError(f"{d}: batch {b} exceeds the export's batch size {sess.batch_size}")
        for length in prompt_lengths:
            if length + new_tokens > sess.max_seq:
                raise UserInputError(
                    f"{d}: prompt {length} + {new_tokens} new tokens exceeds the sequence length {sess.max_seq}"
                )
            pick_context_bucket(sess.plan.context, length)  # clear error if no bucket holds it
            ids = [synthetic_prompt(tok, length)] * b
            out.append(_Config(sess, tok, ids, new_tokens, ref, d, index, info["threads"]))
    return out


class _Config:
    """One (export, batch, prompt length): its runs, and the read-bandwidth samples around them."""

    def __init__(self, sess, tok, ids, new_tokens, ref, export_dir, index: int, threads: int):
        self.sess, self.tok, self.ids, self.new_tokens = sess, tok, ids, new_tokens
        self.ref, self.export_dir, self.index, self.threads = ref, export_dir, index, threads
        self.label = f"{Path(export_dir).name}: batch {len(ids)}, prompt {len(ids[0])}"
        self.ours, self.theirs, self.itl = [], [], []
        self.bandwidth: list[list[float]] = []  # [before, after] each run

    def sample(self) -> float:  # the read ceiling of the device the export runs on

        return read_bandwidth_gbs(self.threads, reps=3, device=self.sess.plan.device)

    def generate(self):

        b = len(self.ids)
        return generate(self.sess, self.tok, [""] * b, self.new_tokens, eos_ids=set(), prompt_ids=self.ids)

    def warm(self, warmup: int) -> None:

        for _ in range(warmup):
            self.generate()
            if self.ref is not None:
                transformers_generate(self.ref, self.ids, 4)

    def run_once(self) -> None:

        before = self.sample()
        res = self.generate()
        self.bandwidth.append([before, self.sample()])
        self.ours.append(res)
        self.itl += res.inter_token_s
        if self.ref is not None:
            self.theirs.append(transformers_generate(self.ref, self.ids, self.new_tokens))

    def row(self) -> dict:
        sess, ours, theirs, itl, bandwidth = self.sess, self.ours, self.theirs, self.itl, self.bandwidth
        b, length, new_tokens = len(self.ids), len(self.ids[0]), self.new_tokens
        med = statistics.median
        decode_tps = med(r.decode_tokens_per_s for r in ours)
        ttft = med(r.ttft_s for r in ours)
        nbytes = step_bytes(sess, length + new_tokens // 2)  # the typical step of the run
        row = {
            "export": str(self.export_dir),
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
            "read_buffer_mib": read_buffers_mib(),  # of the peak: the bandwidth samples' buffer
            "bytes_per_decode_step": nbytes,
            "huge_page_fraction": _huge_page_fraction(sess),
        }
        steps_per_s = 1.0 / row["itl_ms"]["p50"] * 1000
        row["read_gbs_achieved"] = steps_per_s * nbytes / 1e9
        row["read_bandwidth_gbs"] = max(max(pair) for pair in bandwidth)
        row["fraction_of_read_roofline"] = row["read_gbs_achieved"] / row["read_bandwidth_gbs"]
        # Paired: each run against the better of the two samples taken just before and after it, then
        # the median over runs. On a host whose read rate moves between minutes, this compares a run
        # with the machine it ran on; the figure above compares the typical step with the best moment.
        row["fraction_of_read_roofline_paired"] = med(
            nbytes / float(np.median(r.inter_token_s)) / 1e9 / max(pair)
            for r, pair in zip(ours, bandwidth, strict=True)
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
    arena = sess.session.arena
    return arena.huge_bytes() / arena.size if arena is not None else None
