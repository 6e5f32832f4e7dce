"""nxdc's own CPU kernels for the decode hot path, built once per machine on first use.

``nxdc::linear_f32(x, w)``, ``linear_f16(x, w)``, ``linear_bf16(x, w)`` and
``linear_i8(x, w, scale)`` (``linear.cpp``): fp32 activations [M, K] times fp32 / fp16 / bf16 /
int8 weights [N, K] (int8: symmetric, fp32 ``scale [N]`` per row or ``[N, K // G]`` per group,
see ``quant.py``), weights converted in registers, fp32 accumulation, any M. Memory-bound at
decode: every weight is streamed once at the rate of a plain reduction (~2.5x PyTorch's MKL
sgemv on our CI machine); faster than MKL's sgemm at prefill too (AVX-512).

``nxdc::swiglu(x, w, scale=None)`` (``linear.cpp``): an MLP's gate and up matvecs (``w`` stacks
them, any of those formats) and ``silu(gate) * up`` in one call, each thread on its own columns.

``nxdc::attend(q, k_cache, v_cache, positions)`` (``attention.cpp``): prefill, decode and verify
attention over the static KV cache, reading only the slots each query row attends to.

All are registered with TORCH_LIBRARY, so torch.export captures them and AOTInductor calls
them from compiled graphs; the process that runs such a graph must have loaded the library
first (``ensure_loaded``). AVX-512 and AVX2/FMA paths are chosen at run time.

The library is compiled from ``SOURCES`` with the system C++ compiler into
``<cache>/kernels/<hash>/`` (hash of the sources, torch version and flags), under a file lock.
Where it cannot be built or the CPU lacks AVX2/FMA, ``ensure_loaded()`` is False and the
model uses PyTorch's ops instead. An export keeps a copy of the library it was compiled against
and ``generate`` loads that copy (``load_export_library``), not this nxdc's build."""

from __future__ import annotations

import functools
import hashlib
import logging
import os
from pathlib import Path

import torch

log = logging.getLogger(__name__)
# every C++ source compiled into the one library; all of them go into the digest
SOURCES = [Path(__file__).with_name(f) for f in ("linear.cpp", "attention.cpp")]
HEADERS = [Path(__file__).with_name("vexp.h")]  # included by the sources: in the digest too
CFLAGS = ["-O3", "-mavx2", "-mfma", "-fopenmp"]


def cpu_supported() -> bool:
    try:
        cap = torch.backends.cpu.get_cpu_capability()
    except Exception:
        return False
    return cap in ("AVX2", "AVX512")


def kernel_digest() -> str:
    h = hashlib.sha256()
    for src in SOURCES + HEADERS:
        h.update(src.read_bytes())
    h.update(torch.__version__.encode())
    h.update(" ".join(CFLAGS).encode())
    return h.hexdigest()[:16]


def build_dir() -> Path:
    from nxdc.cache.store import default_root

    return default_root() / "kernels" / kernel_digest()


# The kernel library this process has loaded (one per process: every build registers the same
# op names): its digest and file. Set by ensure_loaded() or load_export_library().
_loaded: dict[str, str] = {}
LIBRARY = "nxdc_kernels.so"


def loaded_library() -> tuple[str, Path] | None:
    """(digest, path) of the kernel library loaded in this process, if any."""
    return (_loaded["digest"], Path(_loaded["path"])) if _loaded else None


@functools.cache
def ensure_loaded() -> bool:
    """Build (once per machine) and load the kernel library; False where unavailable."""
    if os.environ.get("NXDC_DISABLE_KERNELS", "") not in ("", "0") or not cpu_supported():
        return False
    if _loaded:  # an export's own copy, loaded by load_export_library
        if _loaded["digest"] == kernel_digest():
            return True
        log.warning(
            "this process runs an export's nxdc kernels %s, not this nxdc's %s: using PyTorch's ops",
            _loaded["digest"],
            kernel_digest(),
        )
        return False
    try:
        from filelock import FileLock
        from torch.utils.cpp_extension import load

        d = build_dir()
        d.mkdir(parents=True, exist_ok=True)
        with FileLock(str(d / ".build.lock")):
            # torch's own build baton: a file `lock` that load() waits on for as long as it exists. A
            # build interrupted by Ctrl-C leaves it behind, and every later run would hang; under
            # .build.lock (held by any nxdc that builds here, released when it dies) it is stale.
            (d / "lock").unlink(missing_ok=True)
            so = load(
                name="nxdc_kernels",
                sources=[str(s) for s in SOURCES],
                extra_cflags=CFLAGS,
                extra_ldflags=["-fopenmp"],
                is_python_module=False,
                build_directory=str(d),
                verbose=False,
            )
        so = so if isinstance(so, str) else str(d / LIBRARY)
        _load(so, kernel_digest())
        return True
    except Exception as e:  # no compiler, no headers, ...: fall back to PyTorch kernels
        log.warning("nxdc CPU kernels unavailable, using PyTorch's (%s)", e)
        return False


def load_export_library(export_dir: Path, digest: str, entry: dict | None, verify: bool = True) -> None:
    """Load the kernel library an export's graphs were compiled against: the copy in the export
    (``entry``: path and sha256 in nxdc.json), so an export runs with exactly its own kernels
    whatever nxdc version is installed, and a machine that only generates needs no compiler.
    Exports written before the copy existed load this nxdc's build if the digest matches."""
    from nxdc.cache.keys import sha256_file
    from nxdc.errors import ExportDirError

    if entry is not None:
        path = Path(export_dir) / entry["path"]
        if not path.is_file():
            raise ExportDirError(
                f"{export_dir}: kernel library {entry['path']} is missing: re-run nxdc export"
            )
        if verify and sha256_file(path) != entry["sha256"]:
            raise ExportDirError(f"{export_dir}: kernel library {entry['path']} is corrupt (sha256 mismatch)")
    if _loaded.get("digest") == digest:
        return
    if not cpu_supported():
        raise ExportDirError(
            f"{export_dir} uses nxdc's CPU kernels, which need AVX2/FMA: re-export here with NXDC_DISABLE_KERNELS=1"
        )
    if entry is None:
        if digest != kernel_digest():
            raise ExportDirError(
                f"{export_dir} was compiled against nxdc kernels {digest} and carries no copy of them "
                f"(this nxdc's are {kernel_digest()}): re-run nxdc export"
            )
        if not ensure_loaded():
            raise ExportDirError(
                f"{export_dir} uses nxdc's CPU kernels, which cannot be built or run on this machine "
                f"(needs AVX2/FMA and a C++ compiler): re-export here with NXDC_DISABLE_KERNELS=1"
            )
        return
    if _loaded:
        raise ExportDirError(
            f"{export_dir} was compiled against nxdc kernels {digest}, but this process already runs "
            f"kernels {_loaded['digest']} (from another export or this nxdc): one process runs one "
            "kernel build; re-export one of them with this nxdc"
        )
    try:
        _load(str(path), digest)
    except (OSError, RuntimeError) as e:
        raise ExportDirError(f"{export_dir}: kernel library {entry['path']} does not load here ({e})") from e


def _load(path: str, digest: str) -> None:
    torch.ops.load_library(path)
    _register_fake()
    _loaded.update(digest=digest, path=path)


def _linear_fake(x, w, scale=None):  # x fp32 [M, K], w [N, K] -> out fp32 [M, N]
    return x.new_empty((x.shape[0], w.shape[0]))


# Shape functions for torch.export, one per op. An export made by an older nxdc carries a library
# without the newer ops (``generate`` loads that copy), so only the ops it defines get one.
_FAKES = {
    "attend": lambda q, k_cache, v_cache, positions, rows=None: torch.empty_like(
        q
    ),  # out [B, H, R, D] like q
    "linear_f32": _linear_fake,
    "linear_f16": _linear_fake,
    "linear_bf16": _linear_fake,
    "linear_i8": _linear_fake,  # scale fp32 [N] (per row) or [N, K // G] (per group of G inputs)
    "swiglu": lambda x, w, scale=None: x.new_empty((x.shape[0], w.shape[0] // 2)),  # w = [gate; up]
}


def _register_fake() -> None:
    for name, fake in _FAKES.items():
        if hasattr(torch.ops.nxdc, name):
            torch.library.register_fake(f"nxdc::{name}")(fake)
