"""``nxdc cache push / pull / sync``: moving entries and registry records between the local
store and a remote (each download verified by ``nxdc.sync.fetch``)."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nxdc.cache.store import CompileCache, verify_entry
from nxdc.errors import CacheError
from nxdc.sync.fetch import fetch
from nxdc.sync.maintenance import local_entries
from nxdc.sync.registry import REGISTRY, check_record, load_records, write_record
from nxdc.sync.remotes import Remote, RemoteCorrupt

log = logging.getLogger("nxdc.cache")


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
            d, fetched = fetch(cache, remote, ns, key, parts)
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
