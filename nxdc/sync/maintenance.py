"""The local store's housekeeping: ``nxdc cache verify / prune / list`` and their option parsing."""

from __future__ import annotations

import json
import re
import shutil
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from filelock import Timeout

from nxdc.cache.store import CompileCache, verify_entry
from nxdc.errors import UserInputError
from nxdc.sync.remotes import Remote


def local_entries(cache: CompileCache) -> Iterable[tuple[str, str, Path, dict[str, Any]]]:
    for d, meta in cache.entries():
        if d.name.startswith(".") or d.parent.name.startswith("."):
            continue  # a temp dir of a write in progress
        yield d.parent.name, d.name, d, meta


def entry_dirs(cache: CompileCache) -> list[Path]:
    return sorted(
        d
        for d in cache.compile_dir.glob("*/*")
        if d.is_dir() and not d.name.startswith(".") and not d.parent.name.startswith(".")
    )


def entry_size(d: Path) -> int:
    return sum(f.stat().st_size for f in d.iterdir() if f.is_file())


def last_used(d: Path, meta: dict[str, Any] | None = None) -> float:
    try:
        mtime = (d / "meta.json").stat().st_mtime
    except OSError:
        mtime = 0.0
    created = (meta or {}).get("created")
    return max(mtime, float(created)) if isinstance(created, int | float) else mtime


def verify_all(cache: CompileCache, discard: bool = True) -> dict[str, Any]:
    """Re-hash every entry; corrupt ones are discarded (under their lock) unless told not to."""
    checked, corrupt = 0, []
    for d in entry_dirs(cache):
        checked += 1
        problem = verify_entry(d)
        if problem is None:
            continue
        item = {"namespace": d.parent.name, "key": d.name, "problem": problem, "discarded": False}
        if discard:
            with cache.lock(d.parent.name, d.name):
                if d.is_dir() and verify_entry(d) is not None:  # still corrupt under the lock
                    cache.discard(d)
                    item["discarded"] = True
        corrupt.append(item)
    return {"checked": checked, "ok": checked - len(corrupt), "corrupt": corrupt}


def prune(
    cache: CompileCache,
    older_than: float | None = None,
    max_size: int | None = None,
    dry_run: bool = False,
    now: float | None = None,
) -> dict[str, Any]:
    """Remove entries unused for ``older_than`` seconds, then the least recently used until
    the store holds at most ``max_size`` bytes; entries being written are skipped. Also
    removes temp dirs left by killed processes (older than an hour)."""
    now = time.time() if now is None else now
    items = []
    for d in entry_dirs(cache):
        try:
            meta = json.loads((d / "meta.json").read_text())
        except (OSError, json.JSONDecodeError):
            meta = None
        items.append((last_used(d, meta), entry_size(d), d))
    items.sort()
    removed, busy = [], []
    for used, size, d, why in _doomed(items, older_than, max_size, now):
        item = {
            "namespace": d.parent.name,
            "key": d.name,
            "bytes": size,
            "age_s": round(now - used),
            "why": why,
        }
        if not dry_run:
            lock = cache.lock(d.parent.name, d.name)
            try:
                lock.acquire(timeout=0)
            except Timeout:
                busy.append(item)
                continue
            try:
                cache.discard(d)
            finally:
                lock.release()
        removed.append(item)
    stale = _stale_temp_dirs(cache, now, dry_run)
    kept = sum(s for _, s, _ in items) - sum(i["bytes"] for i in removed)
    return {
        "removed": removed,
        "busy": busy,
        "stale_temp_dirs": stale,
        "bytes_kept": kept,
        "dry_run": dry_run,
    }


def _doomed(
    items: list[tuple[float, int, Path]], older_than: float | None, max_size: int | None, now: float
) -> list[tuple[float, int, Path, str]]:
    """The entries to remove, least recently used first: unused for ``older_than`` seconds, then
    as many more as bring the store to ``max_size`` bytes."""
    total = sum(s for _, s, _ in items)
    doomed = []
    for used, size, d in items:
        too_old = older_than is not None and now - used > older_than
        too_big = max_size is not None and total > max_size
        if too_old or too_big:
            doomed.append((used, size, d, "age" if too_old else "size"))
            total -= size
    return doomed


def _stale_temp_dirs(cache: CompileCache, now: float, dry_run: bool) -> int:
    """Temp dirs of writes, pulls and discards that a killed process left (older than an hour)."""
    stale = 0
    for d in cache.compile_dir.glob("*/.*"):
        if (
            d.is_dir()
            and d.name.startswith((".tmp-", ".pull-", ".trash-"))
            and now - d.stat().st_mtime > 3600
        ):
            stale += 1
            if not dry_run:
                shutil.rmtree(d, ignore_errors=True)
    return stale


def list_local(cache: CompileCache, now: float | None = None) -> list[dict[str, Any]]:
    now = time.time() if now is None else now
    out = []
    for ns, key, d, meta in local_entries(cache):
        parts = meta.get("parts", {})
        created = meta.get("created")
        out.append(
            {
                "namespace": ns,
                "key": key,
                "bucket": parts.get("bucket") or parts.get("kind"),  # "kernels": the kernel library
                "arch": (parts.get("model") or {}).get("arch"),
                "bytes": entry_size(d),
                "age_s": round(now - created) if isinstance(created, int | float) else None,
                "idle_s": round(now - last_used(d, meta)),
            }
        )
    return sorted(out, key=lambda e: (e["namespace"], e["key"]))


def list_remote(remote: Remote, now: float | None = None) -> list[dict[str, Any]]:
    now = time.time() if now is None else now
    return [
        {
            "namespace": e.namespace,
            "key": e.key,
            "bytes": e.size,
            "age_s": round(now - e.mtime) if e.mtime is not None else None,
        }
        for e in sorted(remote.entries().values(), key=lambda e: (e.namespace, e.key))
    ]


_SIZE = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "m": 10**6,
    "mb": 10**6,
    "g": 10**9,
    "gb": 10**9,
    "t": 10**12,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_AGE = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_size(text: str) -> int:
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _SIZE:
        raise UserInputError(f"--max-size: expected a size like 5GB, 500MiB or 1024 (got {text!r})")
    return int(float(m.group(1)) * _SIZE[m.group(2).lower()])


def parse_age(text: str) -> float:
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([smhdw])\s*", text)
    if not m:
        raise UserInputError(f"--older-than: expected an age like 30d, 12h, 90m or 2w (got {text!r})")
    return float(m.group(1)) * _AGE[m.group(2)]
