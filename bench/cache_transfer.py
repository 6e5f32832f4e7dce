"""Compile once, export anywhere: machine A exports into an empty cache and pushes it to a
``file://`` remote; machine B (another empty cache, the remote set, a C/C++ compiler that always
fails, ``--require-cache``) exports the same plan. Reports B's wall time ÷ A's and checks that
both exports generate the same greedy tokens.

    python bench/cache_transfer.py tiny                      # a tiny random Llama (written here)
    python bench/cache_transfer.py smollm2-135m --config configs/smollm2-135m-cpu.toml

Each "machine" is a fresh process with its own NXDC_CACHE_DIR, so A pays for everything a new
machine pays for (the CPU kernel library included) and B for whatever it cannot pull."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NXDC = [sys.executable, "-m", "nxdc.cli.main"]
TINY_FLAGS = ["--tp", "1", "--batch-size", "2", "--sequence-length", "64"]
TINY_FLAGS += ["--context-buckets", "16,32", "--decode-buckets", "32,64"]


def run(cmd: list[str], env: dict[str, str]) -> tuple[float, subprocess.CompletedProcess]:
    t0 = time.perf_counter()
    res = subprocess.run(cmd, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if res.returncode != 0:
        sys.exit(f"failed ({res.returncode}): {' '.join(cmd)}\n{res.stderr[-2000:]}")
    return wall, res


def tiny_model(d: Path) -> str:
    """A tiny random Llama no cache has seen (a fresh seed each run)."""
    sys.path.insert(0, str(ROOT / "tests"))
    from tiny import make_tiny_llama

    return str(make_tiny_llama(d / "tiny-llama", seed=int(time.time()) % 100_000))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", help="'tiny' or a model nxdc export takes")
    ap.add_argument("--config", help="export config (TOML)")
    ap.add_argument("--prompt", default="The capital of France is")
    ap.add_argument("--json-out", type=Path, help="write the result here too")
    args = ap.parse_args()

    with tempfile.TemporaryDirectory(prefix="nxdc-transfer-") as tmp:
        tmp = Path(tmp)
        model = tiny_model(tmp) if args.model == "tiny" else args.model
        flags = TINY_FLAGS if args.model == "tiny" else []
        if args.config:
            flags += ["--config", args.config]
        prompt = "w5 w6 w7 w8" if args.model == "tiny" else args.prompt
        (tmp / "remote").mkdir()
        remote = f"file://{tmp / 'remote'}"
        base = {k: v for k, v in os.environ.items() if k not in ("NXDC_CACHE_REMOTE", "NXDC_CACHE_DIR")}
        env_a = {**base, "NXDC_CACHE_DIR": str(tmp / "cache-a")}
        broken = tmp / "no-compiler"
        broken.write_text("#!/bin/sh\necho 'no compiler on machine B' >&2\nexit 1\n")
        broken.chmod(0o755)
        env_b = {**base, "NXDC_CACHE_DIR": str(tmp / "cache-b"), "NXDC_CACHE_REMOTE": remote}
        env_b.update(CC=str(broken), CXX=str(broken))

        a_wall, a = run([*NXDC, "export", model, "-o", str(tmp / "a"), *flags, "--json"], env_a)
        push_wall, _ = run([*NXDC, "cache", "push", "--remote", remote, "-q"], env_a)
        b_cmd = [*NXDC, "export", model, "-o", str(tmp / "b"), *flags, "--require-cache", "--json"]
        b_wall, b = run(b_cmd, env_b)
        gen = ["generate", "--prompt", prompt, "--max-new-tokens", "16", "--json"]
        ids = [
            json.loads(run([*NXDC, gen[0], str(tmp / x), *gen[1:]], env)[1].stdout)["results"][0]["token_ids"]
            for x, env in (("a", env_a), ("b", env_b))
        ]
        a_sum, b_sum = json.loads(a.stdout), json.loads(b.stdout)
        result = {
            "model": args.model,
            "config": args.config,
            "a_export_s": round(a_wall, 1),
            "a_compiled": a_sum["compiled"],
            "push_s": round(push_wall, 1),
            "b_export_s": round(b_wall, 1),
            "b_compiled": b_sum["compiled"],
            "b_cache_hits": b_sum["cache_hits"],
            "b_over_a": round(b_wall / a_wall, 3),
            "greedy_tokens_equal": ids[0] == ids[1],
        }
    print(json.dumps(result, indent=1))
    if args.json_out:
        args.json_out.write_text(json.dumps(result, indent=1) + "\n")
    if not result["greedy_tokens_equal"] or result["b_compiled"]:
        sys.exit("B's export differs from A's")


if __name__ == "__main__":
    main()
