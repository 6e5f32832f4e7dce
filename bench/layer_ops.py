"""One linear layer of the 1B / 8B shapes: the exact kernel against the op that replaces it in
the prefill graphs (``prefill_linear``, bf16 tiles, 128 rows) or the decode graphs
(``linear_q8``, int8 activations, 1 row), alternated call by call so host noise hits both alike.
Prints the median of each, the weight bytes it streams per second and the speed-up.

    .venv/bin/python bench/layer_ops.py --path decode                     # docs/performance.md
    .venv/bin/python bench/layer_ops.py --path prefill --formats int4 bf16
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from nxdc.kernels import ensure_loaded  # noqa: E402
from nxdc.model.quant import quantize_int4, quantize_int8  # noqa: E402

SHAPES = [
    (3072, 2048),
    (16384, 2048),
    (28672, 4096),
    (4096, 14336),
]  # (N, K): 1B qkv / gate+up, 8B gate+up / down
# format -> (exact op, its arguments after x from an fp32 weight)
FORMATS = {
    "int4": ("linear_i4", lambda w: quantize_int4(w, 32, asymmetric=True)),
    "int4-sym": ("linear_i4", lambda w: quantize_int4(w, 32)[:2]),
    "int8-asym-g16": (
        "linear_i8",
        lambda w: (*quantize_int8(w, 16), torch.randn(w.shape[0], w.shape[1] // 16) * 0.01),
    ),
    "int8": ("linear_i8", lambda w: quantize_int8(w, 32)),
    "bf16": ("linear_bf16", lambda w: (w.to(torch.bfloat16),)),
}
PATHS = {"decode": ("linear_q8", 1), "prefill": ("prefill_linear", 128)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--path", choices=PATHS, default="decode")
    ap.add_argument("--formats", nargs="+", choices=FORMATS, default=["int4", "int4-sym", "int8-asym-g16"])
    ap.add_argument("--calls", type=int, default=100, help="timed calls of each op")
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    if not ensure_loaded():
        sys.exit("nxdc's CPU kernels are not available on this machine")
    torch.set_num_threads(a.threads)
    fast_name, rows = PATHS[a.path]
    fast = getattr(torch.ops.nxdc, fast_name)
    for n, k in SHAPES:
        x = torch.randn(rows, k)
        w = torch.randn(n, k)
        for fmt in a.formats:
            name, make = FORMATS[fmt]
            args = make(w)
            exact = getattr(torch.ops.nxdc, name)
            times = {name: [], fast_name: []}
            for i in range(a.calls + 5):
                for label, op in ((name, exact), (fast_name, fast)):
                    t = time.perf_counter()
                    op(x, *args)
                    if i >= 5:
                        times[label].append(time.perf_counter() - t)
            e, f = (statistics.median(times[lbl]) * 1e3 for lbl in (name, fast_name))
            gbs = sum(t.numel() * t.element_size() for t in args) / (f * 1e-3) / 1e9
            print(
                f"{n:>6} x {k:<6} {fmt:<14} {name} {e:7.2f} ms  {fast_name} {f:7.2f} ms ({gbs:5.1f} GB/s)  {e / f:.2f}x"
            )


if __name__ == "__main__":
    main()
