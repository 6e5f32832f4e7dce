#!/usr/bin/env bash
# Reproduces the performance table (docs/performance.md), docs/bench.json and docs/bench.png
# from a fresh clone: `make bench` (after `make install`). ~15 min on 2 cores when cold.
set -euo pipefail
cd "$(dirname "$0")/.."
NXDC=.venv/bin/nxdc
exports=()
for b in 1 4 8; do
  out=bench/exports/smollm2-b$b
  "$NXDC" export smollm2-135m -o "$out" --batch-size "$b" --sequence-length 1024 --context-buckets 128,512 --quiet
  exports+=("$out")
done
"$NXDC" bench "${exports[@]}" --prompt-lengths 128,512 --new-tokens 128 --runs 3 \
  --compare transformers --json docs/bench.json --plot docs/bench.png
