"""What every remote offers: a flat tree of files mirroring the local cache root.

Paths are POSIX, relative to the remote's root: ``compile/<namespace>/<key>/<file>`` and
``registry/<model digest>/<record>.json``. An entry exists on a remote once its ``meta.json``
does (uploaders write it last, or in the same atomic commit), so an interrupted push never
looks like a complete entry."""

from __future__ import annotations

import abc
import re
from dataclasses import dataclass
from pathlib import Path

from nxdc.errors import CacheError

# what a remote may name: no "/", no "..", no hidden files; "(9,0)" is a CUDA namespace's ISA
SAFE_PART = re.compile(r"^[A-Za-z0-9_+=(),-][A-Za-z0-9._+=(),-]*$")


class RemoteUnavailable(CacheError):
    """The remote cannot be reached, does not exist, or refused us (auth, offline...)."""


class RemoteCorrupt(CacheError):
    """A remote entry does not match its own meta.json (sha256, size, key)."""

    problem = "corrupt"  # a short reason, for miss reasons and reports


@dataclass(frozen=True)
class RemoteFile:
    size: int
    mtime: float | None = None  # seconds since the epoch, where the remote says


@dataclass(frozen=True)
class RemoteEntry:
    namespace: str
    key: str
    size: int  # bytes of every file, meta.json included
    mtime: float | None


def safe_path(path: str) -> str:
    """Refuse remote-supplied names that could escape the cache root."""
    parts = path.split("/")
    if not parts or not all(SAFE_PART.match(p) for p in parts):
        raise RemoteCorrupt(f"unsafe path on the remote: {path!r}")
    return path


class Remote(abc.ABC):
    """Base class; subclasses implement the file operations marked abstract."""

    url: str

    @abc.abstractmethod
    def list_files(self, prefix: str) -> dict[str, RemoteFile]:
        """Every file under ``prefix`` (a folder, no trailing slash), recursively, by path."""
        ...

    @abc.abstractmethod
    def read_bytes(self, path: str) -> bytes | None:
        """The file's content, or None when it does not exist."""
        ...

    @abc.abstractmethod
    def download(self, path: str, dest: Path) -> None:
        """Write the file to ``dest`` (a path in a temp dir the caller owns)."""
        ...

    @abc.abstractmethod
    def upload(self, files: list[tuple[str, Path]], message: str) -> None:
        """Upload (remote path, local file) pairs in order; meta.json files come last per entry."""
        ...

    def prepare_push(self) -> None:  # noqa: B027 (optional hook, not abstract)
        """Called once before a push (the Hub creates the repo here); nothing by default."""

    # -- derived -------------------------------------------------------------------------

    def entries(self) -> dict[tuple[str, str], RemoteEntry]:
        """Complete entries (those with a meta.json), by (namespace, key)."""
        grouped: dict[tuple[str, str], list[tuple[str, RemoteFile]]] = {}
        for path, info in self.list_files("compile").items():
            parts = path.split("/")
            if len(parts) != 4:
                continue
            grouped.setdefault((parts[1], parts[2]), []).append((parts[3], info))
        out = {}
        for (ns, key), files in grouped.items():
            names = {n for n, _ in files}
            if "meta.json" not in names:
                continue  # an interrupted upload: not an entry
            mtimes = [i.mtime for _, i in files if i.mtime is not None]
            out[(ns, key)] = RemoteEntry(
                ns, key, sum(i.size for _, i in files), max(mtimes) if mtimes else None
            )
        return out

    def __str__(self) -> str:
        return self.url
