"""The export directory's manifest (``nxdc.json``): the one contract between export and
everything that reads an export (generate, serve, bench, the cache registry). ``Manifest`` is the
only way code reads it: typed fields, checked once when loaded, written by ``to_dict``."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import nxdc
from nxdc.errors import ExportDirError
from nxdc.plan import ExportPlan
from nxdc.spec import ModelSpec

MANIFEST = "nxdc.json"
FORMAT = 1


@dataclass(frozen=True)
class FileRef:
    """A file of the export (a rank's weights, the kernel library)."""

    path: str  # relative to the export directory
    bytes: int
    sha256: str


@dataclass(frozen=True)
class Artifact:
    """One compiled graph: its files (what the backend wrote: an AOTInductor package, or a
    StableHLO program and its signature, ...), its compile-cache key and the inputs it was traced
    with (all int64, contiguous; the runtime feeds exactly these shapes)."""

    files: dict[str, FileRef]  # by the name the backend gave it in the cache entry
    key: str
    inputs: tuple[tuple[str, tuple[int, ...]], ...]

    @property
    def bytes(self) -> int:
        return sum(f.bytes for f in self.files.values())

    @property
    def shapes(self) -> list[tuple[int, ...]]:
        return [shape for _, shape in self.inputs]


@dataclass(frozen=True)
class Manifest:
    nxdc_version: str
    torch_version: str
    source: str
    spec: ModelSpec
    plan: ExportPlan
    weights: dict[str, FileRef]  # "rank0", "rank1", ...
    artifacts: dict[str, Artifact]  # by bucket name
    kernels: str | None = None  # digest of the nxdc CPU kernels the graphs call (None: none)
    kernel_library: FileRef | None = None  # the copy of that library in the export
    # decode / verify graphs take a negative position for an idle batch row and write nothing
    # there (exports without it fed idle rows token 0 at slot 0)
    idle_rows: bool = False
    created: float = 0.0
    format: int = field(default=FORMAT)

    def rank_weights(self, rank: int) -> FileRef | None:
        return self.weights.get(f"rank{rank}")

    def to_dict(self) -> dict[str, Any]:
        d = {
            "format": self.format,
            "nxdc_version": self.nxdc_version,
            "torch_version": self.torch_version,
            "source": self.source,
            "spec": self.spec.to_dict(),
            "plan": self.plan.to_dict(),
            "weights": {r: vars(f) for r, f in self.weights.items()},
            "kernels": self.kernels,
            "artifacts": {
                n: {
                    "key": a.key,
                    "files": {name: vars(f) for name, f in a.files.items()},
                    "inputs": [[name, list(shape)] for name, shape in a.inputs],
                }
                for n, a in self.artifacts.items()
            },
            "idle_rows": self.idle_rows,
            "created": self.created,
        }
        if self.kernel_library is not None:
            d["kernel_library"] = vars(self.kernel_library)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Manifest:
        lib = d.get("kernel_library")
        return cls(
            format=d["format"],
            nxdc_version=d.get("nxdc_version", "?"),
            torch_version=d["torch_version"],
            source=d.get("source", "?"),
            spec=ModelSpec.from_dict(d["spec"]),
            plan=ExportPlan.from_dict(d["plan"]),
            weights={r: FileRef(**f) for r, f in d["weights"].items()},
            artifacts={
                n: Artifact(
                    files={name: FileRef(**f) for name, f in _artifact_files(a).items()},
                    key=a["key"],
                    inputs=tuple((name, tuple(shape)) for name, shape in a["inputs"]),
                )
                for n, a in d["artifacts"].items()
            },
            kernels=d.get("kernels"),
            kernel_library=FileRef(**lib) if lib else None,
            idle_rows=bool(d.get("idle_rows")),
            created=float(d.get("created") or 0.0),
        )

    def write(self, export_dir: Path) -> None:
        (Path(export_dir) / MANIFEST).write_text(json.dumps(self.to_dict(), indent=1))


def _artifact_files(a: dict[str, Any]) -> dict[str, Any]:
    """An artifact's files; exports of nxdc 0.1 before several files per bucket held one
    AOTInductor package as ``path`` / ``sha256`` / ``bytes``."""
    if "files" in a:
        return a["files"]
    return {"model.pt2": {"path": a["path"], "sha256": a["sha256"], "bytes": a["bytes"]}}


def load_manifest(export_dir: str | Path) -> Manifest:
    """The manifest of an export this process can run (written for this torch version)."""
    import torch

    d = Path(export_dir)
    m = read_manifest(d)
    if m.torch_version != torch.__version__:
        raise ExportDirError(
            f"{d} was compiled with torch {m.torch_version} but this is torch {torch.__version__}: "
            f"compiled graphs only load in the torch they were built with; re-run nxdc export"
        )
    return m


def read_manifest(export_dir: str | Path) -> Manifest:
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
        raw = json.loads(f.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ExportDirError(f"{f} is unreadable ({e}): re-run nxdc export") from e
    if not isinstance(raw, dict) or raw.get("format") != FORMAT:
        got = raw.get("format") if isinstance(raw, dict) else None
        version = raw.get("nxdc_version") if isinstance(raw, dict) else None
        raise ExportDirError(
            f"{d} was written in export format {got} by nxdc {version}; "
            f"this nxdc {nxdc.__version__} reads format {FORMAT}: re-run nxdc export"
        )
    try:
        return Manifest.from_dict(raw)
    except (KeyError, TypeError, ValueError) as e:
        raise ExportDirError(
            f"{f} is incomplete or from another nxdc ({type(e).__name__}: {e}): re-run nxdc export"
        ) from e
