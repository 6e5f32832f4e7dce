"""nxdc's own CPU kernels for the decode hot path, built once per machine on first use.

``nxdc::linear_f32(x, w)``, ``linear_f16(x, w)``, ``linear_bf16(x, w)``,
``linear_i8(x, w, scale, min=None)`` and ``linear_i4(x, w, scale, min=None)`` (``linear.cpp``):
fp32 activations [M, K] times fp32 / fp16 / bf16 / int8 / int4 weights [N, K] (int8: fp32
``scale [N]`` per row or ``[N, K // G]`` per group; int4: two weights a byte, per group; either
with an optional per-group ``min``; see ``nxdc/model/quant.py``), weights converted in registers, fp32
accumulation, any M. Memory-bound at
decode: every weight is streamed once at the rate of a plain reduction (~2.5x PyTorch's MKL
sgemv on our CI machine); faster than MKL's sgemm at prefill too (AVX-512).

``nxdc::swiglu(x, w, scale=None, min=None)`` (``linear.cpp``): an MLP's gate and up matvecs (``w`` stacks
them, any of those formats) and ``silu(gate) * up`` in one call, each thread on its own columns.

``nxdc::prefill_linear`` / ``prefill_swiglu`` (``prefill.cpp``, same arguments): what the prefill
graphs call instead. bfloat16 / int8 / int4 weights run on AMX bf16 tiles through PyTorch's
oneDNN brgemm, activations and weights rounded to bf16, fp32 accumulation; other formats, CPUs
without AMX and calls under 16 rows take the ops above.

``nxdc::linear_q8`` / ``swiglu_q8`` (``decode_q8.cpp``, the int8 / int4 ops' arguments): what the
decode and verify graphs of int4 weights (and a GGUF's K-quant int8 layers) call with
``--decode-matmul int8``: activations quantized to int8 in blocks of 32, AVX-512 VNNI integer
dot products, fp32 scaling; CPUs without VNNI take the exact ops.

``nxdc::attend(q, k_cache, v_cache, positions)`` (``attention.cpp``): prefill, decode and verify
attention over the static KV cache, reading only the slots each query row attends to.

All are registered with TORCH_LIBRARY, so torch.export captures them and AOTInductor calls
them from compiled graphs; the process that runs such a graph must have loaded the library
first (``ensure_loaded``). AVX-512 and AVX2/FMA paths are chosen at run time.

The library is a compile-cache entry like a graph (``kernel_entry``: namespace
``kernels-cpu-<torch>-<isa>``, key over the sources, torch version, flags, ISA): found locally,
pulled (sha256-verified) from the cache remote, or compiled from ``SOURCES`` with the system C++
compiler under the entry's lock and cached; ``nxdc cache push`` shares it with the graphs.
Where it cannot be built or the CPU lacks AVX2/FMA, ``ensure_loaded()`` is False and the
model uses PyTorch's ops instead. An export keeps a copy of the library it was compiled against
and ``generate`` loads that copy (``load_export_library``), not this nxdc's build."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from nxdc.cache.keys import digest, sha256_file
from nxdc.cache.store import CompileCache
from nxdc.errors import CacheError, ExportDirError

log = logging.getLogger(__name__)
# every C++ source compiled into the one library; all of them go into the digest
SOURCES = [
    Path(__file__).with_name(f) for f in ("linear.cpp", "prefill.cpp", "decode_q8.cpp", "attention.cpp")
]
HEADERS = [
    Path(__file__).with_name(f) for f in ("vexp.h", "linear.h")
]  # included by the sources: in the digest too
# -ffp-contract=off: a product and a sum written apart stay apart (never one FMA), so a dequantised
# weight q * s + m has the bits of the reference's (model/quant.py) and gguf's
CFLAGS = ["-O3", "-mavx2", "-mfma", "-ffp-contract=off", "-fopenmp"]


def cpu_isa() -> str:
    """The CPU's vector ISA as PyTorch sees it ("avx512", "avx2", ...): part of every CPU
    compile-cache namespace."""
    try:
        return torch.backends.cpu.get_cpu_capability().lower()
    except Exception:  # older torch or unusual CPU
        return "unknown"


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


# The kernel library this process has loaded (one per process: every build registers the same
# op names): its digest and file. Set by ensure_loaded() or load_export_library().
_loaded: dict[str, str] = {}
LIBRARY = "nxdc_kernels.so"
BUILD_INFO = "build.json"  # beside the library in its cache entry: compiler, flags, when


def loaded_library() -> tuple[str, Path] | None:
    """(digest, path) of the kernel library loaded in this process, if any."""
    return (_loaded["digest"], Path(_loaded["path"])) if _loaded else None


def disabled() -> bool:
    return os.environ.get("NXDC_DISABLE_KERNELS", "") not in ("", "0")


def kernel_entry() -> tuple[str, str, dict]:
    """(namespace, key, key parts) of this nxdc's kernel library in the compile cache. The key
    is what decides the library's code and where it runs: the sources (and torch version and
    flags, in the digest), the CPU's ISA and architecture. The compiler that built it is recorded
    in the entry (``build.json``) but is not part of the key: a machine that pulls the library must
    find it without a compiler of its own."""
    parts = {
        "kind": "kernels",
        "sources": kernel_digest(),
        "flags": CFLAGS,
        "torch": torch.__version__,
        "isa": cpu_isa(),
        "machine": platform.machine(),
    }
    ns = f"kernels-cpu-{torch.__version__}-{cpu_isa()}".replace("/", "_").replace(" ", "")
    return ns, digest(parts), parts


@dataclass(frozen=True)
class KernelLoad:
    """How this process got its kernel library (``ensure_loaded``'s answer): usable or not, and
    ``reason``: "hit", "pulled from remote URL", the miss reason and "built" (for the export's
    progress line), or why the kernels are unavailable. True where usable."""

    ok: bool
    hit: bool
    reason: str

    def __bool__(self) -> bool:
        return self.ok


_result: list[KernelLoad] = []  # this process's answer, once found (loading a library is per process)


def ensure_loaded(cache=None) -> KernelLoad:
    """Load this nxdc's kernel library from the compile cache (``cache``; default: the local
    one), which pulls it from the cache remote when it has one, else build it with the system
    C++ compiler and cache it; false where unavailable (disabled, no AVX2/FMA, no compiler).
    With ``--require-cache`` a library that would have to be built is an error. The answer is
    the same for the rest of the process."""
    if not _result:
        _result.append(_find_library(cache))
    return _result[0]


def _find_library(cache) -> KernelLoad:
    if disabled() or not cpu_supported():
        return KernelLoad(False, False, "disabled" if disabled() else "CPU lacks AVX2/FMA")
    if _loaded:  # an export's own copy, loaded by load_export_library
        same = _loaded["digest"] == kernel_digest()
        if not same:
            log.warning(
                "this process runs an export's nxdc kernels %s, not this nxdc's %s: using PyTorch's ops",
                _loaded["digest"],
                kernel_digest(),
            )
        return KernelLoad(same, True, "loaded from an export")
    try:
        path, hit, reason = _cached_library(cache or CompileCache())
        _load(str(path), kernel_digest(), already=not hit)
        return KernelLoad(True, hit, reason)
    except CacheError:
        raise
    except Exception as e:  # no compiler, no headers, ...: fall back to PyTorch kernels
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        log.warning("nxdc CPU kernels unavailable, using PyTorch's (%s)", first)
        return KernelLoad(False, False, f"unavailable: {first}")


def _cached_library(cache) -> tuple[Path, bool, str]:
    """(library path, found in a cache, why): a cache hit or pull, else a build that is cached
    (and already loaded into this process by the build: torch's loader dlopens what it builds)."""
    ns, key, parts = kernel_entry()
    found = cache.get(ns, key, parts)
    if found.path is not None:
        return found.path / LIBRARY, True, found.reason
    if getattr(cache, "require", False):
        raise CacheError(
            "nxdc's CPU kernels are neither in the local cache nor on the remote, and --require-cache "
            "forbids building them: push them from a machine that built them (nxdc cache push)"
        )
    with cache.lock(ns, key):
        again = cache.get(ns, key, parts)  # another process may have built it meanwhile
        if again.path is not None:
            return again.path / LIBRARY, True, "hit (built concurrently)"
        with tempfile.TemporaryDirectory(prefix=".kernels-build-", dir=cache.compile_dir) as tmp:
            so = _build(Path(tmp) / "build")
            entry = Path(tmp) / "entry"
            entry.mkdir()
            shutil.copy2(so, entry / LIBRARY)
            info = {"compiler": (compiler() or ("?", os.environ.get("CXX", "c++")))[1], "cflags": CFLAGS}
            (entry / BUILD_INFO).write_text(json.dumps(info, indent=1))
            d = cache.put(ns, key, parts, entry)
    return d / LIBRARY, False, f"{found.reason} → built"


def _build(d: Path) -> Path:
    """Compile the sources into a fresh directory (a build interrupted by Ctrl-C leaves nothing
    a later one waits on: torch's own build baton lived in the shared build directory)."""
    from torch.utils.cpp_extension import load

    d.mkdir(parents=True)
    so = load(
        name="nxdc_kernels",
        sources=[str(s) for s in SOURCES],
        extra_cflags=CFLAGS,
        extra_ldflags=["-fopenmp"],
        is_python_module=False,
        build_directory=str(d),
        verbose=False,
    )
    return Path(so if isinstance(so, str) else d / LIBRARY)


def compiler() -> tuple[str, str] | None:
    """The C++ compiler torch's builds use (``CXX``, else ``c++``) and its version line, if it runs."""
    cxx = os.environ.get("CXX", "c++")
    path = shutil.which(cxx)
    if path is None:
        return None
    try:
        res = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    if res.returncode != 0:
        return None
    return cxx, res.stdout.strip().splitlines()[0] if res.stdout.strip() else cxx


def load_export_library(export_dir: Path, digest: str, entry, verify: bool = True) -> None:
    """Load the kernel library an export's graphs were compiled against: the copy in the export
    (``entry``: the manifest's ``FileRef`` to it, path and sha256), so an export runs with exactly its own kernels
    whatever nxdc version is installed, and a machine that only generates needs no compiler.
    Exports written before the copy existed load this nxdc's build if the digest matches."""
    if entry is not None:
        path = Path(export_dir) / entry.path
        if not path.is_file():
            raise ExportDirError(f"{export_dir}: kernel library {entry.path} is missing: re-run nxdc export")
        if verify and sha256_file(path) != entry.sha256:
            raise ExportDirError(f"{export_dir}: kernel library {entry.path} is corrupt (sha256 mismatch)")
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
        raise ExportDirError(f"{export_dir}: kernel library {entry.path} does not load here ({e})") from e


def _load(path: str, digest: str, already: bool = False) -> None:
    """Load the library at ``path`` (``already``: a byte-identical copy of it was loaded by the
    build; the ops register once per process)."""
    if not already:
        torch.ops.load_library(path)
    _register_fake()
    _loaded.update(digest=digest, path=path)


def _linear_fake(x, w, scale=None, min=None):  # x fp32 [M, K], w [N, K] -> out fp32 [M, N]
    return x.new_empty((x.shape[0], w.shape[0]))


def _swiglu_fake(x, w, scale=None, min=None):  # w = [gate; up] [2I, K] -> out fp32 [M, I]
    return x.new_empty((x.shape[0], w.shape[0] // 2))


# Shape functions for torch.export, one per op. An export made by an older nxdc carries a library
# without the newer ops (``generate`` loads that copy), so only the ops it defines get one.
_FAKES = {
    # out [B, H, R, D], contiguous whatever q's strides (the kernel's output; empty_like would keep
    # q's, and Inductor, which may hand q in as a transposed view, would then misread the result)
    "attend": lambda q, k_cache, v_cache, positions, rows=None: q.new_empty(q.shape),
    "linear_f32": _linear_fake,
    "linear_f16": _linear_fake,
    "linear_bf16": _linear_fake,
    "linear_i8": _linear_fake,  # scale fp32 [N] (per row) or [N, K // G] (per group of G inputs)
    "linear_i4": _linear_fake,  # w uint8 [N, K // 2]
    "swiglu": _swiglu_fake,
    "prefill_linear": _linear_fake,  # any of those weight formats
    "prefill_swiglu": _swiglu_fake,
    "linear_q8": _linear_fake,  # int8 / int4 weights
    "swiglu_q8": _swiglu_fake,
}


def _register_fake() -> None:
    for name, fake in _FAKES.items():
        if hasattr(torch.ops.nxdc, name):
            torch.library.register_fake(f"nxdc::{name}")(fake)
