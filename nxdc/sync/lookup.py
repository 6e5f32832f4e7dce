"""``nxdc cache lookup``: the export configurations recorded for a model, and where their
compiled graphs (and the kernel library they call) are."""

from __future__ import annotations

import json
import logging
from typing import Any

from nxdc.cache.store import CompileCache
from nxdc.errors import CacheError
from nxdc.kernels import kernel_entry
from nxdc.sync.registry import REGISTRY, check_record, load_records, summarize, unusable_reason
from nxdc.sync.remotes import Remote, RemoteUnavailable

log = logging.getLogger("nxdc.cache")


def lookup(cache: CompileCache, model_digest: str, remote: Remote | None = None) -> dict[str, Any]:
    """Export configurations recorded for this model, with where their graphs all are and, for
    those whose graphs call nxdc's CPU kernels, where the kernel library is."""

    records = {r["id"]: r for r in load_records(cache.root, model_digest)}
    on_remote: set[tuple[str, str]] | None = None
    remote_error = None
    if remote is not None:
        try:
            files = remote.list_files(f"{REGISTRY}/{model_digest}")
            for path in sorted(files):
                rid = path.rsplit("/", 1)[-1].removesuffix(".json")
                if rid in records or not path.endswith(".json"):
                    continue
                raw = remote.read_bytes(path)
                try:
                    rec = check_record(json.loads(raw or b"null"), f"{remote.url}/{path}")
                except (json.JSONDecodeError, UnicodeDecodeError, CacheError) as e:
                    log.warning("skipping registry record %s/%s: %s", remote.url, path, e)
                    continue
                records[rec["id"]] = rec
            on_remote = set(remote.entries())
        except RemoteUnavailable as e:
            remote_error = str(e)
    k_ns, k_key, _ = kernel_entry()
    kernels_local = (cache.entry_dir(k_ns, k_key) / "meta.json").is_file()
    rows = []
    for rec in records.values():
        ns, keys = rec["namespace"], rec["keys"]
        n_local = sum((cache.entry_dir(ns, k) / "meta.json").is_file() for k in keys)
        row = summarize(rec)
        row["local"] = _availability(n_local, len(keys))
        row["remote"] = (
            None if on_remote is None else _availability(sum((ns, k) in on_remote for k in keys), len(keys))
        )
        # the kernel library its graphs call (this nxdc's: another one makes the record unusable)
        row["kernels"] = (
            None
            if rec.get("kernels") is None
            else {
                "key": k_key,
                "local": "complete" if kernels_local else "none",
                "remote": None
                if on_remote is None
                else ("complete" if (k_ns, k_key) in on_remote else "none"),
            }
        )
        row["unusable_reason"] = unusable_reason(rec)
        row["usable_here"] = row["unusable_reason"] is None
        rows.append(row)
    rows.sort(
        key=lambda r: (not r["usable_here"], r["tp"] or 0, r["batch_size"] or 0, r["sequence_length"] or 0)
    )
    return {
        "model_digest": model_digest,
        "remote": remote.url if remote else None,
        "remote_error": remote_error,
        "configs": rows,
    }


def _availability(have: int, total: int) -> str:
    if have == total:
        return "complete"
    return "none" if have == 0 else f"partial {have}/{total}"
