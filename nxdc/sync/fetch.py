"""Downloading one compile-cache entry, verified.

Every download lands in a temp dir next to its final place, is checked file by file against
the sha256 and size in the entry's meta.json (and the key against a hash of its key parts),
and is renamed into place under the entry's file lock. Nothing that fails a check is kept."""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

from nxdc.cache.keys import canonical, digest, sha256_file
from nxdc.cache.store import CompileCache, verify_entry
from nxdc.sync.remotes import Remote, RemoteCorrupt
from nxdc.sync.remotes.base import SAFE_PART

KEY = re.compile(r"^[0-9a-f]{64}$")


class EntryRejected(RemoteCorrupt):
    def __init__(self, remote: Remote, key: str, problem: str):
        self.problem = problem
        super().__init__(f"{remote.url}: entry {key[:16]} rejected: {problem}; not used")


def _check_meta(remote: Remote, key: str, raw: bytes, parts: dict[str, Any] | None) -> dict[str, Any]:
    try:
        meta = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise EntryRejected(remote, key, "unreadable meta.json") from None
    if not isinstance(meta, dict) or meta.get("key") != key or not isinstance(meta.get("parts"), dict):
        raise EntryRejected(remote, key, "meta.json is for another key")
    if digest(meta["parts"]) != key:
        raise EntryRejected(remote, key, "key parts in meta.json do not hash to the key")
    if parts is not None and canonical(meta["parts"]) != canonical(parts):
        raise EntryRejected(remote, key, "key parts differ from this export's")
    files = meta.get("files")
    if not isinstance(files, dict) or not files:
        raise EntryRejected(remote, key, "no files recorded")
    for name, info in files.items():
        ok = (
            isinstance(name, str)
            and SAFE_PART.match(name)
            and name != "meta.json"
            and isinstance(info, dict)
            and isinstance(info.get("bytes"), int)
            and isinstance(info.get("sha256"), str)
        )
        if not ok:
            raise EntryRejected(remote, key, f"bad file record {name!r}")
    return meta


def fetch(
    cache: CompileCache, remote: Remote, namespace: str, key: str, parts: dict[str, Any] | None
) -> tuple[Path | None, bool]:
    """Download one entry into the local cache, verified: (entry dir, or None where the remote
    lacks it; whether this call downloaded it). Raises RemoteCorrupt (nothing kept) or
    RemoteUnavailable."""
    if not SAFE_PART.match(namespace) or not KEY.match(key):
        raise EntryRejected(remote, key, f"bad entry name {namespace}/{key}")
    base = f"compile/{namespace}/{key}"
    raw = remote.read_bytes(f"{base}/meta.json")
    if raw is None:
        return None, False
    meta = _check_meta(remote, key, raw, parts)
    final = cache.entry_dir(namespace, key)
    with cache.lock(namespace, key):
        if final.is_dir():
            if verify_entry(final) is None:
                return final, False  # another process pulled or built it meanwhile
            cache.discard(final)
        tmp = Path(tempfile.mkdtemp(prefix=f".pull-{key[:12]}-", dir=final.parent))
        try:
            for name, info in meta["files"].items():
                remote.download(f"{base}/{name}", tmp / name)
                got = tmp / name
                if got.stat().st_size != info["bytes"]:
                    raise EntryRejected(
                        remote, key, f"{name} has {got.stat().st_size} bytes, meta.json says {info['bytes']}"
                    )
                if sha256_file(got) != info["sha256"]:
                    raise EntryRejected(remote, key, f"{name} sha256 mismatch")
            (tmp / "meta.json").write_bytes(raw)
            os.rename(tmp, final)  # atomic: the entry appears whole
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return final, True
