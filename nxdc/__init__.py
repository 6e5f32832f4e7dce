"""nxdc: compile-and-run toolchain for decoder LLMs.

    import nxdc

    result = nxdc.export("smollm2-135m", "out/smollm2", sequence_length=256)
    with nxdc.load("out/smollm2") as llm:
        print(llm.generate("Once upon a time", max_new_tokens=32)[0].text)

``nxdc.NxdcModelForCausalLM.from_pretrained("out/smollm2")`` is the same export behind
transformers' ``generate``. docs/python.md has an example of each entry point.

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
    "load": "nxdc.api.model",
    "Model": "nxdc.api.model",
    "Completion": "nxdc.api.model",
    "NxdcModelForCausalLM": "nxdc.api.causal_lm",
}

__all__ = [
    "export",
    "ExportResult",
    "load",
    "Model",
    "Completion",
    "NxdcModelForCausalLM",
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
