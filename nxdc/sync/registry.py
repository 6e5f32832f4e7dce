"""Which export configurations have complete artifact sets: one small JSON record per
finished export, so ``nxdc cache lookup MODEL`` can answer before anything is traced.

Layout: ``<root>/registry/<model digest>/<record id>.json``. The model digest is
``ModelSpec.digest()`` (the architecture, which is what compile-cache keys hash; weights are
not in compiled code). Remotes mirror the same paths."""

from __future__ import annotations

import json
import logging
import os
import re
import tempfile
import time
from pathlib import Path
from typing import Any

from nxdc.cache.keys import digest, model_code_digest
from nxdc.compile.backends.registry import get_backend
from nxdc.compile.graph_keys import namespace
from nxdc.errors import CacheError
from nxdc.kernels import kernel_digest

REGISTRY = "registry"
FORMAT = 1
HEX = re.compile(r"^[0-9a-f]{16,64}$")
log = logging.getLogger("nxdc.cache")


def make_record(manifest, namespace: str) -> dict[str, Any]:
    """A registry record of a finished export (``manifest``: its ``nxdc.manifest.Manifest``)."""

    spec, plan = manifest.spec, manifest.plan.to_dict()
    buckets = {name: a.key for name, a in manifest.artifacts.items()}
    keys = sorted(set(buckets.values()))
    ident = {"model": spec.digest(), "plan": plan, "namespace": namespace, "keys": keys}
    return {
        "format": FORMAT,
        "id": digest(ident)[:32],
        "model": {"digest": spec.digest(), "arch": spec.arch, "source": manifest.source},
        "plan": plan,
        "namespace": namespace,
        "torch": manifest.torch_version,
        "nxdc": manifest.nxdc_version,
        "code": model_code_digest(),
        "kernels": manifest.kernels,
        "buckets": buckets,
        "keys": keys,
        "created": time.time(),
    }


def record_path(root: Path, record: dict[str, Any]) -> Path:
    return Path(root) / REGISTRY / record["model"]["digest"] / f"{record['id']}.json"


def write_record(root: Path, record: dict[str, Any]) -> Path:
    """Temp file + rename: a reader sees a whole record or none."""
    path = record_path(root, record)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".rec-", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(record, f, indent=1)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def record_export(cache, manifest, namespace: str) -> Path | None:
    """Called at the end of a successful export; a registry failure never fails the export."""
    try:
        return write_record(cache.root, make_record(manifest, namespace))
    except Exception as e:  # the export is already published; the record is a convenience
        log.warning("could not record the export in the cache registry: %s", e)
        return None


def check_record(data: Any, where: str) -> dict[str, Any]:
    """Validate a record (from disk or a remote) before trusting its fields."""
    ok = (
        isinstance(data, dict)
        and data.get("format") == FORMAT
        and isinstance(data.get("id"), str)
        and HEX.match(data["id"])
        and isinstance(data.get("model"), dict)
        and isinstance(data["model"].get("digest"), str)
        and HEX.match(data["model"]["digest"])
        and isinstance(data.get("plan"), dict)
        and isinstance(data.get("namespace"), str)
        and isinstance(data.get("keys"), list)
        and all(isinstance(k, str) and HEX.match(k) for k in data["keys"])
    )
    if not ok:
        raise CacheError(f"{where}: not a valid nxdc registry record")
    return data


def load_records(root: Path, model_digest: str | None = None) -> list[dict[str, Any]]:
    base = Path(root) / REGISTRY
    pattern = f"{model_digest}/*.json" if model_digest else "*/*.json"
    out = []
    for p in sorted(base.glob(pattern)):
        if p.name.startswith("."):
            continue
        try:
            out.append(check_record(json.loads(p.read_text()), str(p)))
        except (OSError, json.JSONDecodeError, CacheError) as e:
            log.warning("skipping registry record %s: %s", p, e)
    return out


def current_namespace(plan: dict[str, Any]) -> str | None:
    """This machine's namespace for the record's backend/device (None: not available here)."""
    try:
        return namespace(get_backend(plan["backend"], plan["device"]))
    except Exception:  # backend or device not available on this machine
        return None


def unusable_reason(record: dict[str, Any]) -> str | None:
    """Why this machine's nxdc would not reuse the record's graphs (None: it would). Best
    effort: same model code, same kernels, same backend/device/torch/ISA namespace. (An export
    recomputes its keys anyway; this only saves a wasted look.)"""

    if record.get("code") != model_code_digest():
        return "other nxdc model code"
    if record.get("kernels") not in (None, kernel_digest()):
        return "other nxdc kernels"
    here = current_namespace(record["plan"])
    if here is None:
        return "backend or device not available here"
    if here != record["namespace"]:
        return f"built for {record['namespace']}, this machine is {here}"
    return None


def summarize(record: dict[str, Any]) -> dict[str, Any]:
    plan = record["plan"]
    return {
        "id": record["id"],
        "source": record["model"].get("source"),
        "tp": plan.get("tp"),
        "batch_size": plan.get("batch_size"),
        "sequence_length": plan.get("sequence_length"),
        "dtype": plan.get("dtype"),
        "weights": plan.get("weights") or plan.get("dtype"),
        "kv_cache": plan.get("kv_cache") or plan.get("dtype"),
        "backend": plan.get("backend"),
        "device": plan.get("device"),
        "torch": record.get("torch"),
        "namespace": record["namespace"],
        "buckets": sorted(record.get("buckets") or {}),
        "graphs": len(record["keys"]),
    }
