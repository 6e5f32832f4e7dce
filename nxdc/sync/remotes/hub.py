"""``hf://org/name`` (a model repo) or ``hf://datasets/org/name``, optionally ``@revision``:
a Hugging Face Hub repository, through ``huggingface_hub.HfApi``.

A push is one commit (``create_commit`` with one ``CommitOperationAdd`` per file), so readers
see all of it or none of it. The token is huggingface_hub's usual one (``HF_TOKEN`` or
``hf auth login``); a repo that does not exist yet is created private on the first push."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from huggingface_hub import CommitOperationAdd, HfApi

from nxdc.sync.remotes.base import Remote, RemoteFile, RemoteUnavailable, safe_path


class HubRemote(Remote):
    def __init__(
        self, url: str, repo_id: str, repo_type: str = "model", revision: str | None = None, api=None
    ):
        self.url = url
        self.repo_id = repo_id
        self.repo_type = repo_type
        self.revision = revision
        self._api = api

    @property
    def api(self):
        if self._api is None:
            self._api = HfApi()
        return self._api

    def _fail(self, what: str, e: Exception) -> RemoteUnavailable:
        from huggingface_hub.errors import LocalEntryNotFoundError, RepositoryNotFoundError

        if isinstance(e, RepositoryNotFoundError):
            why = "repository not found (or no access: set HF_TOKEN)"
        elif isinstance(e, LocalEntryNotFoundError) or type(e).__name__ == "OfflineModeIsEnabled":
            why = "cannot reach the Hub (offline, or HF_HUB_OFFLINE is set)"
        else:
            why = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}".rstrip(": ")
        return RemoteUnavailable(f"{self.url}: cannot {what}: {why}")

    @staticmethod
    def _not_found(e: Exception) -> bool:
        from huggingface_hub.errors import EntryNotFoundError, LocalEntryNotFoundError

        return isinstance(e, EntryNotFoundError) and not isinstance(e, LocalEntryNotFoundError)

    def list_files(self, prefix: str) -> dict[str, RemoteFile]:
        out = {}
        try:
            items = self.api.list_repo_tree(
                self.repo_id,
                path_in_repo=prefix,
                recursive=True,
                repo_type=self.repo_type,
                revision=self.revision,
            )
            for item in items:
                size = getattr(item, "size", None)
                if size is None:  # a folder
                    continue
                commit = getattr(item, "last_commit", None)
                mtime = commit.date.timestamp() if commit is not None and commit.date else None
                out[item.path] = RemoteFile(int(size), mtime)
        except Exception as e:  # huggingface_hub raises HTTP, connection and offline errors
            if self._not_found(e):
                return {}  # nothing pushed under this folder yet
            raise self._fail(f"list {prefix}", e) from e
        return out

    def _fetch(self, path: str, tmp: str) -> Path:
        return Path(
            self.api.hf_hub_download(
                self.repo_id,
                safe_path(path),
                repo_type=self.repo_type,
                revision=self.revision,
                local_dir=tmp,
            )
        )

    def read_bytes(self, path: str) -> bytes | None:
        with tempfile.TemporaryDirectory(prefix="nxdc-hub-") as tmp:
            try:
                return self._fetch(path, tmp).read_bytes()
            except Exception as e:
                if self._not_found(e):
                    return None
                raise self._fail(f"read {path}", e) from e

    def download(self, path: str, dest: Path) -> None:
        with tempfile.TemporaryDirectory(prefix=".hub-", dir=dest.parent) as tmp:
            try:
                got = self._fetch(path, tmp)
            except Exception as e:
                raise self._fail(f"download {path}", e) from e
            shutil.move(os.fspath(got), dest)

    def prepare_push(self) -> None:
        try:  # a new repo is created private; an existing one is left as it is
            self.api.create_repo(self.repo_id, repo_type=self.repo_type, private=True, exist_ok=True)
        except Exception as e:
            raise self._fail("create the repository", e) from e

    def upload(self, files: list[tuple[str, Path]], message: str) -> None:
        """One commit holding every file: readers see the whole push or none of it."""
        if not files:
            return
        ops = [
            CommitOperationAdd(path_in_repo=safe_path(p), path_or_fileobj=os.fspath(src)) for p, src in files
        ]
        try:
            self.api.create_commit(
                self.repo_id,
                ops,
                commit_message=message,
                repo_type=self.repo_type,
                revision=self.revision,
            )
        except Exception as e:
            raise self._fail("push", e) from e
