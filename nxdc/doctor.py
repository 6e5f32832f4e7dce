"""``nxdc doctor``: what this host can use (backends, devices, the CPU kernels, the cache), one
check per line. Nothing is built, downloaded or contacted: it reads versions and files."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import platform
import shutil
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

import nxdc
from nxdc.cache.store import default_root
from nxdc.compile.backends.neuron import INSTALL, PACKAGES, missing_packages
from nxdc.compile.backends.xla import INSTALL as XLA_INSTALL
from nxdc.kernels import LIBRARY, cpu_isa, cpu_supported, disabled, kernel_entry
from nxdc.sync.remotes import configured_remote


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool  # usable here (False: missing or unusable; the detail says what to do)
    detail: str


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def checks(cache_dir: Path | None = None) -> list[Check]:
    out = [
        Check("nxdc", True, f"{nxdc.__version__} (Python {platform.python_version()}, {sys.executable})"),
        Check("torch", True, torch.__version__),
        Check("cpu", True, f"{platform.machine()}, ISA {cpu_isa()}, {_cores()} cores usable"),
    ]
    out.append(_kernels(cache_dir))
    cxx = _compiler()
    out.append(
        Check(
            "backend inductor/cpu",
            cxx is not None,
            f"torch.export + AOTInductor (the default), compiles with {cxx}"
            if cxx
            else "no C++ compiler: exports only from a cache remote that holds every graph "
            "(--require-cache); generate and serve run exports as they are",
        )
    )
    if torch.cuda.is_available():
        names = ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))
        out.append(Check("backend inductor/cuda", True, f"CUDA {torch.version.cuda}: {names}"))
    else:
        why = "torch is a CPU build" if torch.version.cuda is None else f"torch has CUDA {torch.version.cuda}"
        out.append(Check("backend inductor/cuda", False, f"no CUDA device ({why})"))
    xla = _version("torch-xla") or _version("torch_xla")
    out.append(
        Check(
            "backend xla",
            xla is not None,
            f"torch-xla {xla}: --backend xla runs on XLA:CPU (tp 1)"
            if xla
            else f"torch-xla not installed (torch {torch.__version__}): {XLA_INSTALL}",
        )
    )
    missing = missing_packages()
    if missing:
        out.append(Check("backend neuron", False, f"missing {', '.join(missing)}: {INSTALL}"))
    else:
        versions = ", ".join(f"{p} {_version(p) or '?'}" for p in PACKAGES)
        out.append(
            Check(
                "backend neuron",
                True,
                f"Neuron SDK found ({versions}); export with --device trn1 | trn2 | inf2 "
                "(this backend has never run: docs/neuron.md)",
            )
        )
    serve = [d for d in ("starlette", "uvicorn", "prometheus-client") if _version(d) is None]
    out.append(
        Check(
            "serve",
            not serve,
            "nxdc serve is available"
            if not serve
            else f"missing {', '.join(serve)}: pip install 'nxdc[serve]'",
        )
    )
    out.append(_cache(cache_dir))
    return out


def _kernels(cache_dir: Path | None) -> Check:
    if disabled():
        return Check("cpu kernels", False, "disabled (NXDC_DISABLE_KERNELS): fp32 graphs use PyTorch's ops")
    if not cpu_supported():
        return Check("cpu kernels", False, "this CPU lacks AVX2/FMA: fp32 graphs use PyTorch's ops")
    ns, key, _ = kernel_entry()
    if ((cache_dir or default_root()) / "compile" / ns / key / LIBRARY).is_file():
        return Check("cpu kernels", True, f"built, in the compile cache ({key[:12]})")
    cxx = _compiler()
    if cxx:
        return Check(
            "cpu kernels", True, f"not built yet: the first fp32 export builds them with {cxx} (~1 min)"
        )
    return Check(
        "cpu kernels",
        False,
        "not built and no C++ compiler: an export pulls them from a cache remote that holds them",
    )


def _compiler() -> str | None:
    """The C++ compiler torch's builds use (``CXX``, else ``c++``), if it runs."""
    cxx = os.environ.get("CXX", "c++")
    path = shutil.which(cxx)
    if path is None:
        return None
    try:
        ok = subprocess.run([path, "--version"], capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.SubprocessError):
        ok = False
    return cxx if ok else None


def _cache(cache_dir: Path | None) -> Check:
    root = Path(cache_dir) if cache_dir else default_root()  # read only: doctor creates nothing
    probe = root if root.exists() else next((p for p in root.parents if p.exists()), Path("/"))
    writable = os.access(probe, os.W_OK)
    url, source = configured_remote(root)
    remote = f"remote {url} (from {source})" if url else "no remote"
    return Check(
        "cache",
        writable,
        f"{root} ({'writable' if writable else 'not writable: set NXDC_CACHE_DIR'}), {remote}",
    )


def as_json(results: list[Check]) -> dict:
    return {"checks": [asdict(c) for c in results]}
