"""``nxdc doctor``: what this host can use (backends, devices, the CPU kernels, the cache), one
check per line. Nothing is built, downloaded or contacted: it reads versions and files."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import platform
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

import nxdc
from nxdc.cache.store import default_root
from nxdc.compile.backends.registry import doctor_lines
from nxdc.kernels import LIBRARY, compiler, cpu_isa, cpu_supported, disabled, kernel_entry
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
    out += [Check(*line) for line in doctor_lines()]  # each backend's own (compile/backends/)
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
    cxx = compiler()
    if cxx:
        return Check(
            "cpu kernels", True, f"not built yet: the first fp32 export builds them with {cxx[0]} (~1 min)"
        )
    return Check(
        "cpu kernels",
        False,
        "not built and no C++ compiler: an export pulls them from a cache remote that holds them",
    )


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
