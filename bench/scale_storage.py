"""One 8B-shaped layer's decode op (``linear_q8`` / ``swiglu_q8``, one row) with its group scales
stored three ways (fp32, fp16, two-level as a GGUF K-quant keeps them), on weights as decode
reads them: from memory, not from the last-level cache. Each format gets enough copies of the
weight (~800 MB) that a pass over them cannot stay in the L3; the formats alternate round by
round. Prints the best round's time per call, the bytes it streams per second, and the speed-up
over fp32 scales against the bytes ratio.

    .venv/bin/python bench/scale_storage.py          # docs/performance.md, "Fewer bytes a weight"
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from nxdc.kernels import ensure_loaded  # noqa: E402
from nxdc.model.quant import pack_int4  # noqa: E402
from nxdc.weights.gguf_quant import k_factors  # noqa: E402

ROTATE_BYTES = 800e6


def two_level(n: int, k: int, group: int, signed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Random K-quant-like group values (an fp16 per 256 weights times an int8 per group): the
    two-level layout and its fp32 values."""
    d = (torch.rand(n, k // 256, 1) * 0.01 + 1e-4).half().float()
    c = torch.randint(-128 if signed else 0, 128 if signed else 64, (n, k // 256, 256 // group)).float()
    v = (d * c).reshape(n, k // group)
    return k_factors(v, 256 // group), v


def per_call(op, x, sets, repeats: int = 6) -> float:
    f = getattr(torch.ops.nxdc, op)
    for a in sets:
        f(x, *a)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        for a in sets:
            f(x, *a)
        times.append((time.perf_counter() - t) / len(sets))
    return sorted(times)[len(times) // 2]


def main() -> None:
    if not ensure_loaded():
        sys.exit("nxdc's CPU kernels are unavailable here")
    torch.set_num_threads(2)
    torch.manual_seed(0)
    cases = [  # 8B gate+up as int4 g32 + min (Q4_K), 8B down as int8 g16 (Q6_K)
        ("swiglu_q8", 28672, 4096, "int4 g32 + min"),
        ("linear_q8", 4096, 14336, "int8 g16"),
    ]
    for op, n, k, what in cases:
        if what.startswith("int4"):
            q = pack_int4(torch.randint(0, 16, (n, k)))
            s2, s = two_level(n, k, 32, False)
            m2, m = two_level(n, k, 32, True)
            forms = {"fp32": (q, s, m), "fp16": (q, s.half(), m.half()), "two-level": (q, s2, m2)}
        else:
            q = torch.randint(-128, 128, (n, k), dtype=torch.int8)
            s2, s = two_level(n, k, 16, True)
            forms = {"fp32": (q, s), "fp16": (q, s.half()), "two-level": (q, s2)}
        copies = max(4, int(ROTATE_BYTES // q.numel()))
        sets = {f: [tuple(t.clone() for t in a) for _ in range(copies)] for f, a in forms.items()}
        x = torch.randn(1, k)
        best = {f: min(per_call(op, x, sets[f]) for _ in range(3)) for f in forms}
        size = {f: sum(t.numel() * t.element_size() for t in a) for f, a in forms.items()}
        for f in forms:
            print(
                f"{op} {n}x{k} {what}, {f} scales: {best[f] * 1e3:.2f} ms ({size[f] / best[f] / 1e9:.1f} GB/s), "
                f"{best['fp32'] / best[f]:.2f}x fp32 scales (bytes {size['fp32'] / size[f]:.3f}x)"
            )
        del sets


if __name__ == "__main__":
    main()
