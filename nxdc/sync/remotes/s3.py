"""``s3://bucket/prefix``: S3 or any S3-compatible object store (MinIO, Ceph, R2...).

Credentials come from boto3's usual chain (env, ~/.aws, instance role); the endpoint from
``NXDC_S3_ENDPOINT_URL`` or ``AWS_ENDPOINT_URL`` (unset: AWS itself). Objects are written
whole by S3, so a reader never sees half an object; meta.json is uploaded after the files."""

from __future__ import annotations

import os
from pathlib import Path

from nxdc.errors import UserInputError
from nxdc.sync.remotes.base import Remote, RemoteFile, RemoteUnavailable, safe_path

NOT_FOUND = {"404", "NoSuchKey", "NotFound"}


def endpoint_url() -> str | None:
    return os.environ.get("NXDC_S3_ENDPOINT_URL") or os.environ.get("AWS_ENDPOINT_URL") or None


class S3Remote(Remote):
    def __init__(self, url: str, bucket: str, prefix: str, client=None):
        self.url = url
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self._client = client

    @property
    def client(self):
        if self._client is None:
            try:
                import boto3
                from botocore.config import Config
            except ImportError:
                raise UserInputError(
                    f"{self.url}: S3 remotes need boto3 (pip install 'nxdc[s3]' or pip install boto3)"
                ) from None
            cfg = Config(connect_timeout=5, read_timeout=60, retries={"max_attempts": 3, "mode": "standard"})
            self._client = boto3.client("s3", endpoint_url=endpoint_url(), config=cfg)
        return self._client

    def _key(self, path: str) -> str:
        safe_path(path)
        return f"{self.prefix}/{path}" if self.prefix else path

    def _fail(self, what: str, e: Exception) -> RemoteUnavailable:
        code = _error_code(e)
        why = {
            "NoSuchBucket": f"bucket {self.bucket!r} does not exist",
            "AccessDenied": "access denied",
            "InvalidAccessKeyId": "invalid credentials",
            "SignatureDoesNotMatch": "invalid credentials",
        }.get(code or "", f"{type(e).__name__}: {e}")
        return RemoteUnavailable(f"{self.url}: cannot {what}: {why}")

    def list_files(self, prefix: str) -> dict[str, RemoteFile]:
        root = self._key(prefix) + "/"
        cut = len(self.prefix) + 1 if self.prefix else 0
        out = {}
        try:
            for page in self.client.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=root
            ):
                for obj in page.get("Contents", []):
                    out[obj["Key"][cut:]] = RemoteFile(int(obj["Size"]), obj["LastModified"].timestamp())
        except Exception as e:  # botocore raises many types (connection, credentials, client)
            raise self._fail(f"list {prefix}", e) from e
        return out

    def read_bytes(self, path: str) -> bytes | None:
        try:
            return self.client.get_object(Bucket=self.bucket, Key=self._key(path))["Body"].read()
        except Exception as e:
            if _error_code(e) in NOT_FOUND:
                return None
            raise self._fail(f"read {path}", e) from e

    def download(self, path: str, dest: Path) -> None:
        try:
            self.client.download_file(self.bucket, self._key(path), os.fspath(dest))
        except Exception as e:
            raise self._fail(f"download {path}", e) from e

    def upload(self, files: list[tuple[str, Path]], message: str) -> None:
        for path, src in files:
            try:
                self.client.upload_file(os.fspath(src), self.bucket, self._key(path))
            except Exception as e:
                raise self._fail(f"upload {path}", e) from e


def _error_code(e: Exception) -> str | None:
    resp = getattr(e, "response", None)
    if isinstance(resp, dict):
        return str(resp.get("Error", {}).get("Code", "")) or None
    return None
