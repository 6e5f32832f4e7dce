"""Microbenchmark of nxdc's decode matvec kernels on SmolLM2-135M shapes.

One "decode step" is every linear layer of the model once: 30 layers x (q 576x576, k 192x576,
v 192x576, o 576x576, gate 1536x576, up 1536x576, down 576x1536) + lm_head 49152x576, each with
its own weight (~134.5M weights: 538 MB in fp32, 269 MB in fp16/bf16, 134 MB in int8), so
nothing stays in cache between steps. For each format and batch size M the script times whole
steps, interleaving the formats round by round so that machine noise hits all of them alike, and
prints the median step time, the weight bytes streamed per second and the tok/s-equivalent
(1 / step time: matvecs only, no attention, norms or runtime overhead).

    .venv/bin/python bench/kernels.py                 # M = 1 and 8, all formats, 2 threads
    .venv/bin/python bench/kernels.py --m 1 4 8 --rounds 30 --formats f16 i8

Formats: fp32 (nxdc::linear_f32), F.linear (fp32, PyTorch), f16 (nxdc::linear_f16), bf16
(nxdc::linear_bf16), i8 (nxdc::linear_i8, per-row scales), i8g32 / i8g64 (per-group scales).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from nxdc.kernels import ensure_loaded  # noqa: E402
from nxdc.model.quant import quantize_int8  # noqa: E402
from nxdc.runtime.arena import HostArena  # noqa: E402

HIDDEN, INTER, KV, LAYERS, VOCAB = 576, 1536, 192, 30, 49152
LAYER_SHAPES = [
    (HIDDEN, HIDDEN),
    (KV, HIDDEN),
    (KV, HIDDEN),
    (HIDDEN, HIDDEN),
    (INTER, HIDDEN),
    (INTER, HIDDEN),
    (HIDDEN, INTER),
]  # (N, K): q, k, v, o, gate, up, down
FORMATS = ["fp32", "F.linear", "f16", "bf16", "i8", "i8g32", "i8g64"]


def model_shapes() -> list[tuple[int, int]]:
    return LAYER_SHAPES * LAYERS + [(VOCAB, HIDDEN)]


def make_weights(fmt: str, fp32: list[torch.Tensor]) -> list[tuple]:
    """Per-layer argument tuples (after x) for the format's op, in one huge-page arena as a
    loaded export keeps them (nxdc/runtime/arena.py)."""
    if fmt in ("fp32", "F.linear"):
        args = [(w,) for w in fp32]
    elif fmt == "f16":
        args = [(w.to(torch.float16),) for w in fp32]
    elif fmt == "bf16":
        args = [(w.to(torch.bfloat16),) for w in fp32]
    elif fmt.startswith("i8"):
        group = int(fmt[3:]) if fmt.startswith("i8g") else None
        args = [quantize_int8(w, group) for w in fp32]
    else:
        raise ValueError(fmt)
    arena = HostArena(HostArena.bytes_for(t for a in args for t in a if isinstance(t, torch.Tensor)))
    return [tuple(arena.copy(t) if isinstance(t, torch.Tensor) else t for t in a) for a in args]


def op_for(fmt: str):
    ops = torch.ops.nxdc
    return {
        "fp32": ops.linear_f32,
        "F.linear": F.linear,
        "f16": ops.linear_f16,
        "bf16": ops.linear_bf16,
    }.get(fmt, ops.linear_i8)


def nbytes(args: tuple) -> int:
    return sum(t.numel() * t.element_size() for t in args)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--m", type=int, nargs="+", default=[1, 8], help="batch rows (default 1 8)")
    ap.add_argument("--formats", nargs="+", default=FORMATS, choices=FORMATS)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=15, help="rounds; each times every format/M once")
    ap.add_argument("--steps", type=int, default=3, help="timed steps per format per round")
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    if not ensure_loaded():
        sys.exit("nxdc kernels unavailable (no compiler or CPU without AVX2)")
    torch.manual_seed(0)
    shapes = model_shapes()
    fp32 = [torch.randn(n, k) * k**-0.5 for n, k in shapes]
    weights = {f: make_weights(f, fp32) for f in args.formats}
    if "fp32" not in args.formats and "F.linear" not in args.formats:
        del fp32
    xs = {(m, k): torch.randn(m, k) for m in args.m for k in {k for _, k in shapes}}
    times: dict[tuple[str, int], list[float]] = {(f, m): [] for f in args.formats for m in args.m}

    def step(fmt: str, m: int) -> None:
        op = op_for(fmt)
        for (_, k), wargs in zip(shapes, weights[fmt], strict=True):
            op(xs[m, k], *wargs)

    for f in args.formats:  # warm up (first-touch, page faults, thread pool)
        for m in args.m:
            step(f, m)
    for _ in range(args.rounds):
        for f in args.formats:
            for m in args.m:
                for _ in range(args.steps):
                    t0 = time.perf_counter()
                    step(f, m)
                    times[f, m].append(time.perf_counter() - t0)

    cap = torch.backends.cpu.get_cpu_capability()
    print(
        f"SmolLM2-135M decode-step matvecs ({len(shapes)} linears), threads={args.threads}, {cap}, "
        f"median of {args.rounds * args.steps} steps"
    )
    head = f"{'format':>9} {'MB/step':>8}"
    for m in args.m:
        head += f" | {'M=' + str(m) + ' ms':>9} {'GB/s':>6} {'tok/s':>7}"
    if len(args.m) > 1:
        head += f" | {'ms ratio':>8} {'thru x':>6}"
    print(head)
    print("-" * len(head))
    for f in args.formats:
        mb = sum(nbytes(a) for a in weights[f]) / 1e6
        line = f"{f:>9} {mb:8.1f}"
        med = {m: statistics.median(times[f, m]) for m in args.m}
        for m in args.m:
            t = med[m]
            line += f" | {t * 1e3:9.2f} {mb / 1e3 / t:6.1f} {1 / t:7.1f}"
        if len(args.m) > 1:
            lo, hi = min(args.m), max(args.m)
            ratio = med[hi] / med[lo]
            line += f" | {ratio:8.2f} {hi / lo / ratio:6.2f}"
        print(line)
    if len(args.m) > 1:
        print(
            "ms ratio: step time at the largest M / smallest M; thru x: tokens/s at the largest M over "
            "the smallest (= M ratio / ms ratio)"
        )


if __name__ == "__main__":
    main()
