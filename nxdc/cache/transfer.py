"""Moving compile-cache entries between the local store and a remote, plus the local
housekeeping commands (verify, prune, list, lookup).

Every download lands in a temp dir next to its final place, is checked file by file against
the sha256 and size in the entry's meta.json (and the key against a hash of its key parts),
and is renamed into place under the entry's file lock. Nothing that fails a check is kept."""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from filelock import FileLock, Timeout

from nxdc.cache.keys import canonical, digest, sha256_file
from nxdc.cache.registry import REGISTRY, check_record, load_records, summarize, unusable_reason, write_record
from nxdc.cache.remotes import Remote, RemoteCorrupt, RemoteUnavailable, configured_remote, open_remote
from nxdc.cache.remotes.base import SAFE_PART
from nxdc.cache.store import CompileCache, Lookup, verify_entry
from nxdc.errors import CacheError, UserInputError
from nxdc.kernels import kernel_entry

log = logging.getLogger("nxdc.cache")
KEY = re.compile(r"^[0-9a-f]{64}$")


# -- the cache an export uses -------------------------------------------------------------


class RemoteCache(CompileCache):
    """A CompileCache that, on a local miss, tries the named remote for that key before the
    caller compiles. An unreachable remote is reported once and then left alone (the export
    compiles locally) unless ``require`` is set, which makes it an error."""

    def __init__(
        self,
        root: Path | None = None,
        remote: Remote | None = None,
        require: bool = False,
        warn: Callable[[str], None] | None = None,
    ):
        super().__init__(root)
        self.remote = remote
        self.require = require
        self.warn = warn or log.warning
        self._locks: dict[str, FileLock] = {}
        self._down: str | None = None
        self._missed: dict[tuple[str, str], str] = {}  # why the remote had nothing usable

    def lock(self, namespace: str, key: str) -> FileLock:
        # one FileLock object per key, so the lock is re-entrant within this process
        # (compile_bucket holds it around a second get(), which may pull under it)
        d = self.compile_dir / namespace
        d.mkdir(parents=True, exist_ok=True)
        path = str(d / f".{key}.lock")
        if path not in self._locks:
            self._locks[path] = FileLock(path)
        return self._locks[path]

    def get(self, namespace: str, key: str, parts: dict[str, Any]) -> Lookup:
        found = super().get(namespace, key, parts)
        if found.path is not None:
            _touch(found.path)
            log.info("cache hit %s/%s", namespace, key[:16])
            return found
        if self.remote is not None:
            if self._down is not None:
                found = Lookup(None, f"{found.reason}; remote unreachable")
            elif (namespace, key) in self._missed:  # asked already (compile_bucket asks twice)
                found = Lookup(None, f"{found.reason}; {self._missed[namespace, key]}")
            else:
                found = self._from_remote(namespace, key, parts, found.reason)
        if found.path is None:
            log.info("cache miss %s/%s: %s", namespace, key[:16], found.reason)
        return found

    def _from_remote(self, namespace: str, key: str, parts: dict[str, Any], reason: str) -> Lookup:
        url = self.remote.url
        try:
            d, fetched = _fetch(self, self.remote, namespace, key, parts)
        except RemoteUnavailable as e:
            self._down = str(e)
            if self.require:
                raise CacheError(f"{e} (--require-cache: not compiling without the remote)") from e
            self.warn(f"remote unreachable, compiling locally: {e}")
            return Lookup(None, f"{reason}; remote unreachable")
        except RemoteCorrupt as e:
            self._missed[namespace, key] = f"remote copy rejected ({e.problem})"
            self.warn(str(e))
        else:
            if d is not None and not fetched:  # another process finished it while we waited
                return Lookup(d, "hit (built concurrently)")
            if d is not None:
                log.info("pulled %s/%s from %s", namespace, key[:16], url)
                return Lookup(d, f"pulled from remote {url}")
            self._missed[namespace, key] = f"not on remote {url}"
        return Lookup(None, f"{reason}; {self._missed[namespace, key]}")


def _touch(d: Path) -> None:
    """Mark an entry as used (prune removes the least recently used first)."""
    try:
        os.utime(d / "meta.json")
    except OSError:
        pass


def open_cache(
    cache_dir: Path | None = None,
    remote: str | None = None,
    require: bool = False,
    warn: Callable[[str], None] | None = None,
) -> RemoteCache:
    """The cache an export uses: local store + the remote the user named, if any."""
    cache = RemoteCache(cache_dir, warn=warn)
    url, _ = configured_remote(cache.root, remote)
    if url:
        cache.remote = open_remote(url)
    if require:
        if cache.remote is None:
            raise UserInputError(
                "--require-cache needs a remote: --remote URL, NXDC_CACHE_REMOTE or `nxdc cache set-remote URL`"
            )
        try:
            cache.remote.list_files(f"{REGISTRY}/probe")  # fail before any work if unreachable
        except RemoteUnavailable as e:
            raise CacheError(f"{e} (--require-cache: not compiling without the remote)") from e
        cache.require = True
    return cache


def resolve_remote(cache: CompileCache, flag: str | None, required: bool = True) -> Remote | None:
    url, _ = configured_remote(cache.root, flag)
    if url:
        return open_remote(url)
    if required:
        raise UserInputError(
            "no remote configured: pass --remote URL, set NXDC_CACHE_REMOTE, or run `nxdc cache set-remote URL`"
        )
    return None


# -- one entry ----------------------------------------------------------------------------


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


def fetch_entry(
    cache: CompileCache, remote: Remote, namespace: str, key: str, parts: dict[str, Any] | None = None
) -> Path | None:
    """Download one entry (None if the remote lacks it) into the local cache, verified.
    Raises RemoteCorrupt (nothing kept) or RemoteUnavailable."""
    return _fetch(cache, remote, namespace, key, parts)[0]


def _fetch(
    cache: CompileCache, remote: Remote, namespace: str, key: str, parts: dict[str, Any] | None
) -> tuple[Path | None, bool]:
    """(entry dir or None, whether this call downloaded it)."""
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


# -- push / pull / sync ---------------------------------------------------------------------


@dataclass
class Transfer:
    remote: str
    uploaded: list[str] = field(default_factory=list)
    downloaded: list[str] = field(default_factory=list)
    present: int = 0  # already on the other side
    rejected: list[dict[str, str]] = field(default_factory=list)  # corrupt, not transferred
    missing: list[str] = field(default_factory=list)  # wanted but not on the remote
    records: int = 0
    bytes: int = 0

    def to_dict(self) -> dict[str, Any]:
        return dict(vars(self))


def local_entries(cache: CompileCache) -> Iterable[tuple[str, str, Path, dict[str, Any]]]:
    for d, meta in cache.entries():
        if d.name.startswith(".") or d.parent.name.startswith("."):
            continue  # a temp dir of a write in progress
        yield d.parent.name, d.name, d, meta


def push(cache: CompileCache, remote: Remote, keys: set[str] | None = None) -> Transfer:
    """Upload the verified local entries (and registry records) the remote lacks."""
    rep = Transfer(remote.url)
    remote.prepare_push()
    on_remote = remote.entries()
    files: list[tuple[str, Path]] = []
    for ns, key, d, meta in local_entries(cache):
        if keys is not None and key not in keys:
            continue
        if (ns, key) in on_remote:
            rep.present += 1
            continue
        problem = verify_entry(d)
        if problem:
            rep.rejected.append({"key": key, "namespace": ns, "problem": problem})
            continue
        names = list(meta["files"])
        files += [(f"compile/{ns}/{key}/{n}", d / n) for n in names]
        files.append((f"compile/{ns}/{key}/meta.json", d / "meta.json"))  # last: marks it complete
        rep.uploaded.append(key)
        rep.bytes += sum((d / n).stat().st_size for n in [*names, "meta.json"])
    if keys is not None:
        rep.missing = sorted(keys - {k for _, k, _, _ in local_entries(cache)})
    # registry records whose every key is on the remote once this push lands
    have = {k for _, k in on_remote} | set(rep.uploaded)
    remote_records = remote.list_files(REGISTRY)
    for rec in load_records(cache.root):
        path = f"{REGISTRY}/{rec['model']['digest']}/{rec['id']}.json"
        if path in remote_records or not set(rec["keys"]) <= have:
            continue
        files.append((path, cache.root / path))
        rep.records += 1
    if files:
        remote.upload(files, f"nxdc cache push: {len(rep.uploaded)} entries, {rep.records} registry records")
    return rep


def pull(
    cache: CompileCache,
    remote: Remote,
    keys: set[str] | None = None,
    wanted: dict[tuple[str, str], dict[str, Any]] | None = None,
    model_digest: str | None = None,
) -> Transfer:
    """Download what the local cache lacks: the entries of a plan (``wanted``: (namespace,
    key) -> key parts), the given ``keys``, or everything; plus the registry records."""
    rep = Transfer(remote.url)
    on_remote = remote.entries()
    targets: list[tuple[str, str, dict[str, Any] | None]]
    if wanted is not None:
        targets = [(ns, k, p) for (ns, k), p in wanted.items() if (ns, k) in on_remote]
        rep.missing = sorted(k for (ns, k) in wanted if (ns, k) not in on_remote)
    elif keys is not None:
        targets = [(ns, k, None) for (ns, k) in on_remote if k in keys]
        rep.missing = sorted(keys - {k for _, k, _ in targets})
    else:
        targets = [(ns, k, None) for (ns, k) in on_remote]
    for ns, key, parts in sorted(targets, key=lambda t: (t[0], t[1])):
        if (cache.entry_dir(ns, key) / "meta.json").is_file():
            rep.present += 1
            continue
        try:
            d, fetched = _fetch(cache, remote, ns, key, parts)
        except RemoteCorrupt as e:
            rep.rejected.append({"key": key, "namespace": ns, "problem": e.problem})
            continue
        if d is None:  # vanished between listing and reading
            rep.missing.append(key)
            continue
        if not fetched:  # a concurrent pull or export got it first
            rep.present += 1
            continue
        rep.downloaded.append(key)
        rep.bytes += sum(f.stat().st_size for f in d.iterdir())
    rep.records = pull_records(cache, remote, model_digest)
    return rep


def pull_records(cache: CompileCache, remote: Remote, model_digest: str | None = None) -> int:
    prefix = f"{REGISTRY}/{model_digest}" if model_digest else REGISTRY
    n = 0
    for path in sorted(remote.list_files(prefix)):
        if not path.endswith(".json") or (cache.root / path).is_file():
            continue
        raw = remote.read_bytes(path)
        if raw is None:
            continue
        try:
            rec = check_record(json.loads(raw), f"{remote.url}/{path}")
        except (json.JSONDecodeError, UnicodeDecodeError, CacheError) as e:
            log.warning("skipping registry record %s/%s: %s", remote.url, path, e)
            continue
        if f"{REGISTRY}/{rec['model']['digest']}/{rec['id']}.json" != path:
            log.warning("skipping registry record %s/%s: stored under the wrong name", remote.url, path)
            continue
        write_record(cache.root, rec)
        n += 1
    return n


# -- local housekeeping -------------------------------------------------------------------


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
    total = sum(s for _, s, _ in items)
    doomed = []
    for used, size, d in items:
        too_old = older_than is not None and now - used > older_than
        too_big = max_size is not None and total > max_size
        if too_old or too_big:
            doomed.append((used, size, d, "age" if too_old else "size"))
            total -= size
    removed, busy = [], []
    for used, size, d, why in doomed:
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
    kept = sum(s for _, s, _ in items) - sum(i["bytes"] for i in removed)
    return {
        "removed": removed,
        "busy": busy,
        "stale_temp_dirs": stale,
        "bytes_kept": kept,
        "dry_run": dry_run,
    }


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


# -- option parsing -------------------------------------------------------------------------

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
