"""Which of the kernels' CPU-dependent paths this machine takes (tests skip or expect by them)."""

from __future__ import annotations

import os
from pathlib import Path


def cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    return set(line.split(":", 1)[-1].split())


_AVX512 = {"avx512f", "avx512bw", "avx512vl"} <= cpu_flags() and os.environ.get("NXDC_KERNELS_AVX2") in (
    None,
    "",
    "0",
)
# prefill's bf16 tiles (kernels/prefill.cpp): AMX (oneDNN's micro-kernel packs bf16 only there), not turned off
TILES = (
    _AVX512
    and {"avx512_bf16", "amx_bf16", "amx_tile"} <= cpu_flags()
    and not os.environ.get("ONEDNN_MAX_CPU_ISA")
    and os.environ.get("NXDC_PREFILL_TILES") != "0"
)
NO_TILES = "CPU without AMX: prefill takes the exact kernels"
# decode's integer products (kernels/decode_q8.cpp): AVX-512 VNNI, not turned off
VNNI = _AVX512 and "avx512_vnni" in cpu_flags() and os.environ.get("NXDC_DECODE_Q8") != "0"
NO_VNNI = "CPU without AVX-512 VNNI: decode takes the exact kernels"


def traced_code(module, x, matmuls=None) -> str:
    """The code of ``module`` exported on ``x``, inside ``matmuls`` (``decode_matmuls()`` /
    ``prefill_matmuls()``: which ops a graph of that kind calls) or outside any."""
    import contextlib

    import torch

    with matmuls if matmuls is not None else contextlib.nullcontext():
        return torch.export.export(module, (x,), strict=False).graph_module.code
