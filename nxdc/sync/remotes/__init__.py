"""Compile-cache remotes, named by URL: ``hf://org/name``, ``file:///path``, ``s3://bucket/prefix``.

nxdc talks only to the remote the user named: ``--remote URL`` on a command, else
``NXDC_CACHE_REMOTE``, else the one saved with ``nxdc cache set-remote`` in
``<cache root>/config.json``. There is no default remote."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from urllib.parse import unquote, urlparse

from nxdc.errors import CacheError, UserInputError
from nxdc.sync.remotes.base import Remote, RemoteCorrupt, RemoteEntry, RemoteFile, RemoteUnavailable

CONFIG = "config.json"
ENV = "NXDC_CACHE_REMOTE"
SCHEMES = "hf://org/name, file:///path or s3://bucket/prefix"


def open_remote(url: str) -> Remote:
    """Parse a remote URL (no network access)."""
    url = url.strip()
    if url.startswith("hf://"):
        from nxdc.sync.remotes.hub import HubRemote

        rest, _, revision = url[len("hf://") :].partition("@")
        parts = [p for p in rest.split("/") if p]
        repo_type = "model"
        if parts and parts[0] in ("datasets", "models"):
            repo_type = parts.pop(0).rstrip("s")
        if len(parts) != 2:
            raise UserInputError(f"remote {url!r}: expected hf://org/name or hf://datasets/org/name")
        return HubRemote(url, "/".join(parts), repo_type, revision or None)
    if url.startswith("file://"):
        from nxdc.sync.remotes.directory import DirectoryRemote

        u = urlparse(url)
        if u.netloc not in ("", "localhost") or not u.path.startswith("/"):
            raise UserInputError(f"remote {url!r}: expected file:///absolute/path (three slashes)")
        return DirectoryRemote(url, Path(unquote(u.path)))
    if url.startswith("s3://"):
        from nxdc.sync.remotes.s3 import S3Remote

        u = urlparse(url)
        if not u.netloc:
            raise UserInputError(f"remote {url!r}: expected s3://bucket[/prefix]")
        return S3Remote(url, u.netloc, u.path)
    raise UserInputError(f"remote {url!r}: unsupported URL (use {SCHEMES})")


def config_path(root: Path) -> Path:
    return Path(root) / CONFIG


def read_config(root: Path) -> dict:
    p = config_path(root)
    if not p.is_file():
        return {}
    try:
        data = json.loads(p.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CacheError(f"cache config {p} is unreadable: {e}") from e
    return data if isinstance(data, dict) else {}


def save_remote(root: Path, url: str | None) -> None:
    """Save (or with None, forget) the remote in ``<root>/config.json``; temp + rename."""
    if url is not None:
        open_remote(url)  # refuse a malformed URL now, not at the next export
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    cfg = read_config(root)
    if url is None:
        cfg.pop("remote", None)
    else:
        cfg["remote"] = url.strip()
    fd, tmp = tempfile.mkstemp(prefix=".config-", dir=root)
    with os.fdopen(fd, "w") as f:
        json.dump(cfg, f, indent=1)
    os.replace(tmp, config_path(root))


def configured_remote(root: Path, flag: str | None = None) -> tuple[str | None, str]:
    """(URL, where it came from): --remote, then NXDC_CACHE_REMOTE, then the config file."""
    if flag:
        return flag, "--remote"
    if os.environ.get(ENV):
        return os.environ[ENV], ENV
    url = read_config(root).get("remote")
    return (url, str(config_path(root))) if url else (None, "")


__all__ = [
    "Remote",
    "RemoteCorrupt",
    "RemoteEntry",
    "RemoteFile",
    "RemoteUnavailable",
    "configured_remote",
    "open_remote",
    "read_config",
    "save_remote",
]
