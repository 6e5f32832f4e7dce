"""``file:///path``: a plain directory, typically a shared NFS mount."""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path

from nxdc.sync.remotes.base import Remote, RemoteFile, RemoteUnavailable, safe_path


class DirectoryRemote(Remote):
    def __init__(self, url: str, path: Path):
        self.url = url
        self.root = path

    def _check(self) -> None:
        if not self.root.is_dir():
            raise RemoteUnavailable(f"{self.url}: directory {self.root} does not exist (is it mounted?)")

    def _path(self, path: str) -> Path:
        return self.root / safe_path(path)

    def list_files(self, prefix: str) -> dict[str, RemoteFile]:
        self._check()
        base = self.root / prefix
        out = {}
        try:
            for p in base.rglob("*"):
                rel = p.relative_to(self.root).as_posix()
                if any(part.startswith(".") for part in rel.split("/")):
                    continue  # temp files of an upload in progress
                if p.is_file():
                    st = p.stat()
                    out[rel] = RemoteFile(st.st_size, st.st_mtime)
        except FileNotFoundError:
            pass  # a file vanished while listing (a concurrent prune)
        except OSError as e:
            raise RemoteUnavailable(f"{self.url}: cannot list {prefix}: {e}") from e
        return out

    def read_bytes(self, path: str) -> bytes | None:
        self._check()
        try:
            return self._path(path).read_bytes()
        except FileNotFoundError:
            return None
        except OSError as e:
            raise RemoteUnavailable(f"{self.url}: cannot read {path}: {e}") from e

    def download(self, path: str, dest: Path) -> None:
        self._check()
        try:
            shutil.copyfile(self._path(path), dest)
        except OSError as e:
            raise RemoteUnavailable(f"{self.url}: cannot read {path}: {e}") from e

    def upload(self, files: list[tuple[str, Path]], message: str) -> None:
        self._check()
        for path, src in files:
            final = self._path(path)
            tmp = final.parent / f".{final.name}.tmp-{uuid.uuid4().hex[:12]}"
            try:
                final.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(src, tmp)
                os.replace(tmp, final)  # readers see the old file or the whole new one
            except OSError as e:
                tmp.unlink(missing_ok=True)
                raise RemoteUnavailable(f"{self.url}: cannot write {path}: {e}") from e
