"""Peak memory per rank and decode speed of SmolLM2-135M at several --tp degrees (docs/tp.md).

    .venv/bin/python bench/tp.py [--tp 1,2,3] [--new-tokens 64] [--cache-dir DIR]

For each degree: exports (warm if the cache has the graphs), then runs ``nxdc generate --json``
and reports each process's peak RSS (VmHWM from /proc, polled every 20 ms: rank 0 is the
command itself, ranks 1.. its workers) with the decode tokens/s rank 0 measured. Linux only.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NXDC = [sys.executable, "-m", "nxdc.cli.main"]
PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def _hwm_kib(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def _children(pid: int) -> list[int]:
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    kids = [int(c) for c in text.split()]
    return kids + [g for k in kids for g in _children(k)]


def _rank_of(pid: int) -> str | None:
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return None
    if b"nxdc.runtime.workers" not in cmd:
        return None
    for kv in env:
        if kv.startswith(b"RANK="):
            return kv[5:].decode()
    return None


def run_tracked(argv: list[str]) -> tuple[subprocess.CompletedProcess, dict[str, float]]:
    """Run ``argv``; peak RSS in MiB of the process ('rank 0'), its workers ('rank R') and the
    largest other descendant ('children', e.g. the C++ compiler)."""
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    peaks: dict[str, int] = {}
    while p.poll() is None:
        for pid in [p.pid, *_children(p.pid)]:
            kib = _hwm_kib(pid)
            if kib is None:
                continue
            if pid == p.pid:
                key = "rank 0"
            else:
                rank = _rank_of(pid)
                key = f"rank {rank}" if rank is not None else "children"
            peaks[key] = max(peaks.get(key, 0), kib)
        time.sleep(0.02)
    out, err = p.communicate()
    return subprocess.CompletedProcess(argv, p.returncode, out, err), {k: v / 1024 for k, v in peaks.items()}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tp", default="1,2,3")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--cache-dir", default=None)
    ap.add_argument("--out", default=str(ROOT / "bench" / "exports"))
    a = ap.parse_args()
    cache = ["--cache-dir", a.cache_dir] if a.cache_dir else []
    rows = []
    for tp in [int(t) for t in a.tp.split(",")]:
        out = Path(a.out) / f"smollm2-tp{tp}"
        t0 = time.perf_counter()
        exp, exp_peaks = run_tracked(
            [
                *NXDC,
                "export",
                "smollm2-135m",
                "-o",
                str(out),
                "--tp",
                str(tp),
                "--sequence-length",
                "256",
                "--context-buckets",
                "128",
                "--decode-buckets",
                "256",
                "--quiet",
                *cache,
            ]
        )
        export_s = time.perf_counter() - t0
        if exp.returncode:
            sys.stderr.write(exp.stderr)
            return 1
        speeds, gen_peaks = [], {}
        for _ in range(a.runs):
            gen, peaks = run_tracked(
                [*NXDC, "generate", str(out), "-p", PROMPT, "-n", str(a.new_tokens), "--chat", "--json"]
            )
            if gen.returncode:
                sys.stderr.write(gen.stderr)
                return 1
            speeds.append(json.loads(gen.stdout)["stats"]["decode_tokens_per_s"])
            gen_peaks = {k: max(v, gen_peaks.get(k, 0)) for k, v in peaks.items()}
        rows.append(
            {
                "tp": tp,
                "export_s": round(export_s, 1),
                "export_peak_rss_mib": exp_peaks,
                "generate_peak_rss_mib": gen_peaks,
                "decode_tokens_per_s": sorted(speeds)[len(speeds) // 2],
            }
        )
        r = rows[-1]
        ranks = ", ".join(f"{k} {v:.0f}" for k, v in sorted(gen_peaks.items()))
        print(
            f"tp {tp}: export {export_s:.0f} s, peak RSS {exp_peaks.get('rank 0', 0):.0f} MiB "
            f"(compiler {exp_peaks.get('children', 0):.0f}); generate peak RSS MiB: {ranks}; "
            f"decode {r['decode_tokens_per_s']:.1f} tok/s (median of {a.runs})",
            flush=True,
        )
    print(json.dumps({"threads": os.cpu_count(), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
