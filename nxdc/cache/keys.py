"""Compile-cache keys: a hash over everything that changes the compiled code."""

from __future__ import annotations

import hashlib
import json
from functools import cache
from pathlib import Path
from typing import Any


def canonical(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str)


def digest(obj: Any) -> str:
    return hashlib.sha256(canonical(obj).encode()).hexdigest()


@cache
def model_code_digest() -> str:
    """Hash of the sources that define the traced graphs (model code, tracing, the kernels' shape
    functions): changing them invalidates every cached artifact; other code does not. Each
    backend adds its own module's hash (``source_digest``) to its key parts."""
    root = Path(__file__).resolve().parent.parent
    traced = (root / "compile" / "trace.py", root / "kernels" / "__init__.py")
    return source_digest(*sorted((root / "model").rglob("*.py")), *traced)


@cache
def source_digest(*files: Path) -> str:
    root = Path(__file__).resolve().parent.parent
    h = hashlib.sha256()
    for f in files:
        h.update(f.relative_to(root).as_posix().encode())
        h.update(f.read_bytes())
    return h.hexdigest()[:16]


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def diff_parts(want: dict[str, Any], have: dict[str, Any], prefix: str = "") -> list[str]:
    """Names of the key parts that differ (nested dicts flattened with dots)."""
    out = []
    for k in sorted(set(want) | set(have)):
        a, b = want.get(k), have.get(k)
        if isinstance(a, dict) and isinstance(b, dict):
            out += diff_parts(a, b, f"{prefix}{k}.")
        elif canonical(a) != canonical(b):
            out.append(f"{prefix}{k}")
    return out
