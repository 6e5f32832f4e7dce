"""The cache an export uses: the local store, which on a miss asks the remote the user named."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from filelock import FileLock

from nxdc.cache.store import CompileCache, Lookup
from nxdc.errors import CacheError, UserInputError
from nxdc.sync.fetch import fetch
from nxdc.sync.registry import REGISTRY
from nxdc.sync.remotes import Remote, RemoteCorrupt, RemoteUnavailable, configured_remote, open_remote

log = logging.getLogger("nxdc.cache")


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
            d, fetched = fetch(self, self.remote, namespace, key, parts)
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
