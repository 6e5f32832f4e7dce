"""The export directory's manifest (``nxdc.json``): the contract between export and generate."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import nxdc
from nxdc.errors import ExportDirError

MANIFEST = "nxdc.json"
FORMAT = 1


def load_manifest(export_dir: str | Path) -> dict[str, Any]:
    """The manifest of an export this process can run (written for this torch version)."""
    import torch

    d = Path(export_dir)
    m = read_manifest(d)
    if m.get("torch_version") != torch.__version__:
        raise ExportDirError(
            f"{d} was compiled with torch {m.get('torch_version')} but this is torch {torch.__version__}: "
            f"compiled graphs only load in the torch they were built with; re-run nxdc export"
        )
    return m


def read_manifest(export_dir: str | Path) -> dict[str, Any]:
    """The manifest, checked for its format only (no torch import: ``nxdc serve``'s HTTP side)."""
    d = Path(export_dir)
    if not d.is_dir():
        raise ExportDirError(f"export directory {d} does not exist")
    f = d / MANIFEST
    if not f.is_file():
        raise ExportDirError(
            f"{d} is not an nxdc export (no {MANIFEST}): run `nxdc export MODEL -o {d}` first"
        )
    try:
        m = json.loads(f.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ExportDirError(f"{f} is unreadable ({e}): re-run nxdc export") from e
    if m.get("format") != FORMAT:
        raise ExportDirError(
            f"{d} was written in export format {m.get('format')} by nxdc {m.get('nxdc_version')}; "
            f"this nxdc {nxdc.__version__} reads format {FORMAT}: re-run nxdc export"
        )
    return m
