"""nxdc's own CPU kernels for the decode hot path, built once per machine on first use.

``nxdc::skinny_linear(x[M, K], w[N, K]) -> [M, N]`` is an fp32 matmul for small M (the decode
batch), with AVX-512 and AVX2/FMA paths chosen at run time: memory-bound, it streams every
weight once at ~2.5x the bandwidth of PyTorch's default (MKL sgemv) on our CI machine. It is registered with TORCH_LIBRARY, so
torch.export captures it and AOTInductor calls it from compiled graphs; the process that runs
such a graph must have loaded the library first (``ensure_loaded``).

``nxdc::linear_f16(x, w)``, ``nxdc::linear_bf16(x, w)`` and ``nxdc::linear_i8(x, w, scale)``
(``matvec_lowp.cpp``) take fp32 activations and fp16 / bf16 / int8 weights ``[N, K]`` (int8:
symmetric, fp32 ``scale [N]`` per row or ``[N, K // G]`` per group, see ``quant.py``), convert
weights to fp32 in registers and accumulate in fp32, for any M.

The library is compiled from ``matvec.cpp`` and ``matvec_lowp.cpp`` with the system C++ compiler into
``<cache>/kernels/<hash>/`` (hash of the source, torch version and flags), under a file lock.
Where it cannot be built or the CPU lacks AVX2/FMA, ``ensure_loaded()`` is False and the
model uses ``F.linear`` instead."""

from __future__ import annotations

import functools
import hashlib
import logging
import os
from pathlib import Path

import torch

log = logging.getLogger(__name__)
SOURCE = Path(__file__).with_name("matvec.cpp")
# every C++ source compiled into the one library (SOURCE first); all of them go into the digest
SOURCES = [SOURCE, Path(__file__).with_name("matvec_lowp.cpp")]
CFLAGS = ["-O3", "-mavx2", "-mfma", "-fopenmp"]
MAX_ROWS = 8  # the kernel handles M <= 8 (larger M is compute-bound: MKL is the right choice)


def cpu_supported() -> bool:
    try:
        cap = torch.backends.cpu.get_cpu_capability()
    except Exception:
        return False
    return cap in ("AVX2", "AVX512")


def kernel_digest() -> str:
    h = hashlib.sha256(SOURCE.read_bytes())
    for src in SOURCES[1:]:
        h.update(src.read_bytes())
    h.update(torch.__version__.encode())
    h.update(" ".join(CFLAGS).encode())
    return h.hexdigest()[:16]


def build_dir() -> Path:
    from nxdc.cache.store import default_root

    return default_root() / "kernels" / kernel_digest()


@functools.cache
def ensure_loaded() -> bool:
    """Build (once per machine) and load the kernel library; False where unavailable."""
    if os.environ.get("NXDC_DISABLE_KERNELS", "") not in ("", "0") or not cpu_supported():
        return False
    try:
        from filelock import FileLock
        from torch.utils.cpp_extension import load

        d = build_dir()
        d.mkdir(parents=True, exist_ok=True)
        with FileLock(str(d / ".build.lock")):
            so = load(
                name="nxdc_kernels",
                sources=[str(s) for s in SOURCES],
                extra_cflags=CFLAGS,
                extra_ldflags=["-fopenmp"],
                is_python_module=False,
                build_directory=str(d),
                verbose=False,
            )
        if isinstance(so, str):
            torch.ops.load_library(so)
        _register_fake()
        return True
    except Exception as e:  # no compiler, no headers, ...: fall back to PyTorch kernels
        log.warning("nxdc CPU kernels unavailable, using PyTorch's (%s)", e)
        return False


def _register_fake() -> None:
    @torch.library.register_fake("nxdc::skinny_linear")
    def _(x, w):
        return x.new_empty((x.shape[0], w.shape[0]))

    # Weight-only reduced precision (matvec_lowp.cpp): x fp32 [M, K]; w fp16 / bf16 / int8 [N, K];
    # int8 scale fp32 [N] (per row) or [N, K // G] (per group of G inputs); out fp32 [M, N].
    @torch.library.register_fake("nxdc::linear_f16")
    def _(x, w):
        return x.new_empty((x.shape[0], w.shape[0]))

    @torch.library.register_fake("nxdc::linear_bf16")
    def _(x, w):
        return x.new_empty((x.shape[0], w.shape[0]))

    @torch.library.register_fake("nxdc::linear_i8")
    def _(x, w, scale):
        return x.new_empty((x.shape[0], w.shape[0]))
