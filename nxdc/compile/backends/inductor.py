"""torch.export + AOTInductor packages, with weights kept out of the compiled code.

Packages are built with ``package_constants_in_so=False``: weights and KV caches are
user-managed constants handed in at load time, shared by every bucket graph."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from nxdc.compile.backends import check_device
from nxdc.errors import UserInputError
from nxdc.kernels import cpu_isa

ARTIFACT = "model.pt2"


def extra_configs() -> dict[str, Any]:
    """``NXDC_INDUCTOR_CONFIG``: a JSON object of further Inductor settings, e.g.
    ``{"max_autotune": true}``, applied to every graph; like every flag, part of the cache key."""
    raw = os.environ.get("NXDC_INDUCTOR_CONFIG")
    if not raw:
        return {}
    try:
        extra = json.loads(raw)
    except ValueError as e:
        raise UserInputError(f"NXDC_INDUCTOR_CONFIG is not valid JSON: {e}") from e
    if not isinstance(extra, dict):
        raise UserInputError("NXDC_INDUCTOR_CONFIG must be a JSON object of Inductor settings")
    from torch._inductor import config

    unknown = sorted(set(extra) - set(config.get_config_copy()))
    if unknown:
        raise UserInputError(
            f"NXDC_INDUCTOR_CONFIG: torch {torch.__version__} has no Inductor setting {unknown[0]!r}"
        )
    return extra


class InductorBackend:
    name = "inductor"
    artifact = ARTIFACT  # the file a cache entry holds

    def __init__(self, device: str = "cpu"):
        self.device = check_device(device)
        extra_configs()  # a bad NXDC_INDUCTOR_CONFIG fails here, before any work

    def inductor_configs(self, kind: str | None = None) -> dict[str, Any]:
        """Inductor settings for a graph of bucket ``kind`` (context / decode / verify).

        always_keep_tensor_constants: Inductor otherwise folds small constants into the code,
        and some are bound per rank at load time (the tensor-parallel rank index).
        cpp.threads = 1 for CPU decode / verify graphs: their generated code (norms, RoPE, SiLU,
        cache writes on a few rows) is microseconds of work, less than an OpenMP fork/join, so
        it runs on the calling thread; nxdc's kernels in the same graph still use every thread."""
        flags: dict[str, Any] = {
            "aot_inductor.package_constants_in_so": False,
            "always_keep_tensor_constants": True,
        }
        if self.device == "cpu" and kind in ("decode", "verify"):
            flags["cpp.threads"] = 1
        flags.update(extra_configs())
        return flags

    def key_parts(self, kind: str | None = None) -> dict[str, Any]:
        return {
            "backend": self.name,
            "device": self.device.split(":")[0],
            "torch": torch.__version__,
            "isa": cpu_isa() if self.device == "cpu" else torch.cuda.get_device_capability(self.device),
            "flags": self.inductor_configs(kind),
        }

    def compile(self, ep: torch.export.ExportedProgram, out_dir: Path, kind: str | None = None) -> Path:
        from torch._inductor import aoti_compile_and_package

        out = out_dir / ARTIFACT
        aoti_compile_and_package(
            ep, package_path=os.fspath(out), inductor_configs=self.inductor_configs(kind)
        )
        return out

    def load(self, path: Path):
        from torch._inductor import aoti_load_package

        return aoti_load_package(os.fspath(path))
