"""In-place vs functional KV-cache writes on the inductor backend: the same SmolLM2 buckets
exported both ways, decode speed from `nxdc generate --json` (median of --runs), greedy tokens
compared. Writes bench/results/kv-update.json.

    .venv/bin/python bench/kv_update.py [--runs 3] [--sequence-length 256]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NXDC = [sys.executable, "-m", "nxdc.cli.main"]
PROMPT = "Write a short paragraph about compilers."


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--sequence-length", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=96)
    args = ap.parse_args()
    out = {"sequence_length": args.sequence_length, "new_tokens": args.new_tokens, "modes": {}}
    for mode in ("in-place", "functional"):
        d = ROOT / "bench" / "exports" / f"kv-update-{mode}"
        flags = ["--sequence-length", str(args.sequence_length), "--context-buckets", "64"]
        flags += ["--decode-buckets", str(args.sequence_length), "--kv-update", mode]
        subprocess.run([*NXDC, "export", "smollm2-135m", "-o", str(d), *flags, "-q"], check=True)
        rates, tokens = [], None
        for _ in range(args.runs):
            res = subprocess.run(
                [
                    *NXDC,
                    "generate",
                    str(d),
                    "--chat",
                    "-n",
                    str(args.new_tokens),
                    "--prompt",
                    PROMPT,
                    "--json",
                ],
                check=True,
                capture_output=True,
                text=True,
            )
            r = json.loads(res.stdout)
            rates.append(r["stats"]["decode_tokens_per_s"])
            tokens = r["results"][0]["token_ids"]
        out["modes"][mode] = {
            "decode_tokens_per_s": rates,
            "median": statistics.median(rates),
            "tokens": tokens,
        }
        print(mode, "decode tok/s median", statistics.median(rates), rates, flush=True)
    same = out["modes"]["in-place"]["tokens"] == out["modes"]["functional"]["tokens"]
    out["same_tokens"] = same
    print("same greedy tokens:", same)
    (ROOT / "bench" / "results" / "kv-update.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
