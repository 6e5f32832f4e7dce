"""nxdc: compile-and-run toolchain for decoder LLMs.

    import nxdc

    result = nxdc.export("smollm2-135m", "out/smollm2", sequence_length=256)

The public names below load on first use (PEP 562), so ``import nxdc`` stays cheap: no torch
until a public function is called."""

from __future__ import annotations

import importlib

from nxdc.errors import CacheError, ExportDirError, NxdcError, UnsupportedError, UserInputError

__version__ = "0.1.0"

# Each lazily loaded public name -> the module that defines it.
_PUBLIC = {
    "export": "nxdc.api.export",
    "ExportResult": "nxdc.pipeline",
}

__all__ = [
    "export",
    "ExportResult",
    "NxdcError",
    "UserInputError",
    "UnsupportedError",
    "CacheError",
    "ExportDirError",
]


def __getattr__(name: str):
    if name not in _PUBLIC:
        raise AttributeError(f"module 'nxdc' has no attribute {name!r}")
    value = getattr(importlib.import_module(_PUBLIC[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_PUBLIC})
