"""Local content-addressed compile cache.

Layout: ``<root>/compile/<namespace>/<key>/`` holding the artifact files and ``meta.json``
(key parts, sha256 and size of every file). Entries are built in a temp dir and renamed into
place, so an interrupted compile never leaves an entry that looks complete; a per-key file
lock keeps concurrent exports from compiling the same graph twice; an entry whose files do not
match their sha256 is discarded, never served."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from filelock import FileLock

from nxdc.cache.keys import canonical, diff_parts, sha256_file
from nxdc.errors import CacheError


def default_root() -> Path:
    env = os.environ.get("NXDC_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "nxdc"


@dataclass
class Lookup:
    path: Path | None  # entry dir on a hit
    reason: str  # "hit" | why it missed


class CompileCache:
    def __init__(self, root: Path | None = None):
        self.root = Path(root) if root else default_root()
        self.compile_dir = self.root / "compile"
        try:
            self.compile_dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise CacheError(f"cannot create the compile cache at {self.root}: {e}") from e

    def entry_dir(self, namespace: str, key: str) -> Path:
        return self.compile_dir / namespace / key

    def lock(self, namespace: str, key: str) -> FileLock:
        d = self.compile_dir / namespace
        d.mkdir(parents=True, exist_ok=True)
        return FileLock(str(d / f".{key}.lock"))

    def get(self, namespace: str, key: str, parts: dict[str, Any]) -> Lookup:
        d = self.entry_dir(namespace, key)
        if not d.is_dir():
            return Lookup(None, self.explain_miss(parts))
        problem = verify_entry(d)
        if problem:
            self.discard(d)
            return Lookup(None, f"corrupt entry discarded ({problem})")
        return Lookup(d, "hit")

    def put(self, namespace: str, key: str, parts: dict[str, Any], src: Path) -> Path:
        """Move the files of directory ``src`` into the cache as entry ``key`` (atomically)."""
        final = self.entry_dir(namespace, key)
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{key[:12]}-", dir=final.parent))
        try:
            files = {}
            for f in sorted(src.iterdir()):
                shutil.move(os.fspath(f), tmp / f.name)
                files[f.name] = {"sha256": sha256_file(tmp / f.name), "bytes": (tmp / f.name).stat().st_size}
            meta = {"key": key, "parts": parts, "files": files, "created": time.time()}
            (tmp / "meta.json").write_text(json.dumps(meta, indent=1, default=str))
            os.chmod(tmp, 0o755)  # mkdtemp's 0700 would hide the entry from other users of a shared cache
            if final.exists():
                self.discard(final)
            os.rename(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return final

    def discard(self, d: Path) -> None:
        trash = d.parent / f".trash-{d.name}-{os.getpid()}-{time.time_ns()}"
        try:
            os.rename(d, trash)
        except OSError:
            return
        shutil.rmtree(trash, ignore_errors=True)

    def entries(self):
        for meta in self.compile_dir.glob("*/*/meta.json"):
            try:
                yield meta.parent, json.loads(meta.read_text())
            except (OSError, json.JSONDecodeError):
                continue

    def explain_miss(self, parts: dict[str, Any]) -> str:
        """Name the key parts that differ from the closest entry for the same graph."""
        best: list[str] | None = None
        for _, meta in self.entries():
            have = meta.get("parts", {})
            if have.get("bucket") != parts.get("bucket"):
                continue
            diff = diff_parts(parts, have)
            if best is None or len(diff) < len(best):
                best = diff
        if best is None:
            return "no entry for this graph"
        if not best:
            return "identical parts, different key (cache format changed)"
        return "differs in " + ", ".join(best[:6])


def verify_entry(d: Path) -> str | None:
    """None when every file matches its recorded sha256; else what is wrong."""
    try:
        meta = json.loads((d / "meta.json").read_text())
    except (OSError, json.JSONDecodeError):
        return "unreadable meta.json"
    for name, info in meta.get("files", {}).items():
        f = d / name
        if not f.is_file():
            return f"{name} missing"
        if f.stat().st_size != info["bytes"] or sha256_file(f) != info["sha256"]:
            return f"{name} sha256 mismatch"
    return None if meta.get("files") else "no files recorded"


def entry_files(d: Path) -> list[str]:
    """The names of an entry's files (what the backend wrote), as its meta.json records them."""
    return sorted(json.loads((d / "meta.json").read_text())["files"])


__all__ = ["CompileCache", "Lookup", "default_root", "verify_entry", "entry_files", "canonical"]
