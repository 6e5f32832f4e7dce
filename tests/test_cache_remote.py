"""Compile-cache remotes: push/pull/sync/list/lookup/verify/prune against a plain directory,
a real S3-compatible server (moto, in server mode on localhost) and a Hugging Face Hub repo
(a fake HfApi whose calls are checked against the real HfApi signatures; the Hub itself is
never contacted). The slow tests export on "machine A" (the session cache), push, then export
on "machine B" (an empty cache) with zero compiles."""

from __future__ import annotations

import importlib
import inspect
import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from tiny import GQA_EXPORT
from typer.testing import CliRunner

from nxdc.cache.keys import digest, sha256_file
from nxdc.cache.store import CompileCache, verify_entry
from nxdc.cli.main import app
from nxdc.errors import CacheError, UserInputError
from nxdc.sync.maintenance import parse_age, parse_size
from nxdc.sync.registry import write_record
from nxdc.sync.remote_cache import RemoteCache
from nxdc.sync.remotes import open_remote

runner = CliRunner()
NS = "inductor-cpu-test-isa"
BUCKET = "nxdc-test"


# -- helpers ------------------------------------------------------------------------------


def cli(*args, code: int = 0):
    res = runner.invoke(app, [str(a) for a in args])
    assert res.exit_code == code, (res.exit_code, res.stdout, res.stderr)
    assert "Traceback" not in res.stdout + res.stderr
    if code:
        errors = [line for line in res.stderr.splitlines() if line.startswith("error:")]
        assert len(errors) == 1, res.stderr  # one line, no traceback
    return res


def cli_json(*args, code: int = 0):
    return json.loads(cli(*args, "--json", code=code).stdout)


def make_entries(root: Path, n: int, start: int = 0) -> list[str]:
    """n fake compile-cache entries (random 'artifacts'), as CompileCache.put writes them."""
    cache = CompileCache(root)
    keys = []
    for i in range(start, start + n):
        parts = {"bucket": f"context-{16 * (i + 1)}", "model": {"arch": "llama"}, "i": i}
        src = root.parent / f".src-{uuid.uuid4().hex}"
        src.mkdir()
        (src / "model.pt2").write_bytes(os.urandom(2000 + 100 * i))
        cache.put(NS, digest(parts), parts, src)
        src.rmdir()
        keys.append(digest(parts))
    return keys


def make_record(root: Path, keys: list[str], batch_size: int = 1) -> dict:
    rec = {
        "format": 1,
        "id": digest(keys)[:32],
        "model": {"digest": "ab" * 8, "arch": "llama", "source": "tiny"},
        "plan": {"tp": 1, "batch_size": batch_size, "sequence_length": 64, "dtype": "fp32"},
        "namespace": NS,
        "keys": sorted(keys),
        "buckets": {},
    }
    write_record(root, rec)
    return rec


def entry_files(root: Path) -> dict[str, str]:
    """{relative path: sha256} of every entry file (not locks, not temp dirs)."""
    base = root / "compile"
    return {
        p.relative_to(base).as_posix(): sha256_file(p)
        for p in sorted(base.rglob("*"))
        if p.is_file() and not any(part.startswith(".") for part in p.relative_to(base).parts)
    }


def leftovers(root: Path) -> list[str]:
    return [p.name for p in (root / "compile").rglob(".*") if p.is_dir()]


# -- remotes ------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    """A real S3 API (moto's server mode) on localhost, with one bucket."""
    boto3 = pytest.importorskip("boto3")
    server_mod = pytest.importorskip("moto.server")
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    port = _free_port()
    server = server_mod.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    env = {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_CONFIG_FILE": str(tmp_path_factory.mktemp("aws") / "none"),
        "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path_factory.mktemp("aws") / "none"),
        "NXDC_S3_ENDPOINT_URL": f"http://127.0.0.1:{port}",
    }
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    client = boto3.client("s3", endpoint_url=env["NXDC_S3_ENDPOINT_URL"])
    client.create_bucket(Bucket=BUCKET)
    yield client
    server.stop()
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def _hub_error(cls, message: str):
    """A huggingface_hub HTTP error as the library raises it (it needs an HTTP response)."""
    from huggingface_hub.errors import HfHubHTTPError

    base = cls.__mro__[cls.__mro__.index(HfHubHTTPError) + 1]
    http = importlib.import_module(base.__module__.split(".")[0])
    return cls(message, response=http.Response(404, request=http.Request("GET", "https://huggingface.co/x")))


class FakeHfApi:
    """Stands in for huggingface_hub.HfApi: keeps repos in a directory. Every call is first
    bound to the real HfApi method's signature, so a wrong argument name fails the test."""

    def __init__(self, store: Path):
        self.store = store
        self.commits: list[list[str]] = []

    def _check(self, name: str, *args, **kwargs) -> None:
        from huggingface_hub import HfApi

        inspect.signature(getattr(HfApi, name)).bind(self, *args, **kwargs)

    def _repo(self, repo_id: str, repo_type: str | None) -> Path:
        return self.store / (repo_type or "model") / repo_id

    def create_repo(self, repo_id, **kw):
        self._check("create_repo", repo_id, **kw)
        self._repo(repo_id, kw.get("repo_type")).mkdir(parents=True, exist_ok=True)

    def create_commit(self, repo_id, operations, **kw):
        from huggingface_hub import CommitOperationAdd

        self._check("create_commit", repo_id, operations, **kw)
        assert kw["commit_message"]
        repo = self._repo(repo_id, kw.get("repo_type"))
        assert repo.is_dir(), "commit to a repo that was not created"
        paths = []
        for op in operations:
            assert isinstance(op, CommitOperationAdd)
            dest = repo / op.path_in_repo
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(op.path_or_fileobj, dest)
            paths.append(op.path_in_repo)
        self.commits.append(paths)

    def list_repo_tree(self, repo_id, path_in_repo=None, **kw):
        from huggingface_hub.errors import EntryNotFoundError, RepositoryNotFoundError
        from huggingface_hub.hf_api import RepoFile, RepoFolder

        self._check("list_repo_tree", repo_id, path_in_repo, **kw)
        repo = self._repo(repo_id, kw.get("repo_type"))
        if not repo.is_dir():
            raise _hub_error(RepositoryNotFoundError, f"{repo_id} not found")
        base = repo / (path_in_repo or "")
        if not base.exists():
            raise EntryNotFoundError(f"{path_in_repo} not found")
        for p in sorted(base.rglob("*") if kw.get("recursive") else base.iterdir()):
            rel = p.relative_to(repo).as_posix()
            if p.is_dir():
                yield RepoFolder(path=rel, oid="0" * 40)
            else:
                yield RepoFile(path=rel, size=p.stat().st_size, oid="0" * 40)

    def hf_hub_download(self, repo_id, filename, **kw):
        from huggingface_hub.errors import RemoteEntryNotFoundError

        self._check("hf_hub_download", repo_id, filename, **kw)
        src = self._repo(repo_id, kw.get("repo_type")) / filename
        if not src.is_file():
            raise _hub_error(RemoteEntryNotFoundError, f"{filename} not found")
        dest = Path(kw["local_dir"]) / filename
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, dest)
        return str(dest)


@pytest.fixture
def fake_hub(tmp_path, monkeypatch):
    import nxdc.sync.remotes.hub as hub

    api = FakeHfApi(tmp_path / "hub")
    monkeypatch.setattr(hub, "HfApi", lambda: api)
    return api


class Remote:
    """A remote URL for a test, plus a way to reach behind nxdc's back (to corrupt it)."""

    def __init__(self, kind: str, url: str, raw_path):
        self.kind, self.url, self.raw_path = kind, url, raw_path

    def corrupt(self, path: str, data: bytes = b"\x00garbage\x00") -> None:
        if self.kind == "s3":
            client, bucket, prefix = self.raw_path
            client.put_object(Bucket=bucket, Key=f"{prefix}/{path}", Body=data)
        else:
            self.raw_path(path).write_bytes(data)


@pytest.fixture(params=["file", "s3", "hub"])
def remote(request, tmp_path):
    return _make_remote(request.param, request, tmp_path)


def _make_remote(kind: str, request, tmp_path) -> Remote:
    if kind == "file":
        d = tmp_path / "remote"
        d.mkdir()
        return Remote(kind, f"file://{d}", lambda p: d / p)
    if kind == "s3":
        client = request.getfixturevalue("s3_server")
        prefix = f"cache-{uuid.uuid4().hex[:8]}"
        return Remote(kind, f"s3://{BUCKET}/{prefix}", (client, BUCKET, prefix))
    api = request.getfixturevalue("fake_hub")
    repo = f"test-org/cache-{uuid.uuid4().hex[:8]}"
    return Remote(kind, f"hf://{repo}", lambda p: api.store / "model" / repo / p)


@pytest.fixture(autouse=True)
def no_configured_remote(monkeypatch):
    monkeypatch.delenv("NXDC_CACHE_REMOTE", raising=False)


# -- push / pull / sync -------------------------------------------------------------------


def test_push_then_pull_into_an_empty_cache(remote, tmp_path, request):
    a, b = tmp_path / "a", tmp_path / "b"
    keys = make_entries(a, 3)
    make_record(a, keys)
    make_record(a, [*keys, "f" * 64], batch_size=4)  # names a key nobody has: not pushed

    up = cli_json("cache", "push", "--remote", remote.url, "--cache-dir", a)
    assert sorted(up["uploaded"]) == sorted(keys) and up["records"] == 1 and up["rejected"] == []
    again = cli_json("cache", "push", "--remote", remote.url, "--cache-dir", a)
    assert again["uploaded"] == [] and again["present"] == 3 and again["records"] == 0
    if remote.kind == "hub":  # one commit per push, holding every file; nothing to push: no commit
        api = request.getfixturevalue("fake_hub")
        assert len(api.commits) == 1 and len(api.commits[0]) == 3 * 2 + 1

    down = cli_json("cache", "pull", "--remote", remote.url, "--cache-dir", b)
    assert sorted(down["downloaded"]) == sorted(keys) and down["records"] == 1
    assert entry_files(b) == entry_files(a)  # every file, meta.json included, byte for byte
    assert [p.name for p in (b / "registry").rglob("*.json")] == [f"{digest(keys)[:32]}.json"]
    assert cli_json("cache", "verify", "--cache-dir", b)["ok"] == 3
    again = cli_json("cache", "pull", "--remote", remote.url, "--cache-dir", b)
    assert again["downloaded"] == [] and again["present"] == 3
    assert leftovers(b) == []


def test_sync_exchanges_both_ways(remote, tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    ka, kb = make_entries(a, 2), make_entries(b, 1, start=5)
    cli("cache", "sync", "--remote", remote.url, "--cache-dir", a)
    res = cli_json("cache", "sync", "--remote", remote.url, "--cache-dir", b)
    assert res["push"]["uploaded"] == kb and sorted(res["pull"]["downloaded"]) == sorted(ka)
    res = cli_json("cache", "sync", "--remote", remote.url, "--cache-dir", a)
    assert res["push"]["uploaded"] == [] and res["pull"]["downloaded"] == kb
    assert entry_files(a) == entry_files(b) and len(entry_files(a)) == 6


def test_pull_selected_keys(remote, tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    keys = make_entries(a, 3)
    cli("cache", "push", "--remote", remote.url, "--cache-dir", a, "-q")
    res = cli_json("cache", "pull", "--key", keys[1], "--remote", remote.url, "--cache-dir", b)
    assert res["downloaded"] == [keys[1]]
    assert [e["key"] for e in cli_json("cache", "list", "--where", "local", "--cache-dir", b)["local"]] == [
        keys[1]
    ]
    res = cli("cache", "pull", "--key", "e" * 64, "--remote", remote.url, "--cache-dir", b, code=1)
    assert f"not found on {remote.url}: eeeeeeeeeeeeeeee" in res.stderr
    res = cli("cache", "pull", "--key", "nope", "--remote", remote.url, "--cache-dir", b, code=2)
    assert "is not a cache key" in res.stderr


def test_list_shows_size_and_age(remote, tmp_path):
    a = tmp_path / "a"
    keys = make_entries(a, 2)
    cli("cache", "push", "--remote", remote.url, "--cache-dir", a, "-q")
    res = cli_json("cache", "list", "--where", "all", "--remote", remote.url, "--cache-dir", a)
    local = {e["key"]: e for e in res["local"]}
    assert set(local) == set(keys) == {e["key"] for e in res["remote"]}
    for e in res["remote"]:
        assert e["bytes"] == local[e["key"]]["bytes"] > 2000  # artifact + meta.json
        if remote.kind != "hub":  # the Hub listing has no dates without expand=True
            assert 0 <= e["age_s"] < 600
    assert all(e["bucket"].startswith("context-") and 0 <= e["age_s"] < 600 for e in res["local"])
    human = cli("cache", "list", "--where", "all", "--remote", remote.url, "--cache-dir", a).stdout
    assert keys[0][:16] in human and remote.url in human and "2 entries" in human


def test_corrupt_remote_entry_is_rejected(remote, tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    keys = make_entries(a, 2)
    cli("cache", "push", "--remote", remote.url, "--cache-dir", a, "-q")
    remote.corrupt(f"compile/{NS}/{keys[0]}/model.pt2")
    res = cli("cache", "pull", "--remote", remote.url, "--cache-dir", b, code=1)
    assert "corrupt entries were not pulled" in res.stderr and "model.pt2 has" in res.stderr
    res = cli_json("cache", "pull", "--remote", remote.url, "--cache-dir", b, code=1)
    assert [r["key"] for r in res["rejected"]] == [keys[0]]
    assert [e["key"] for e in cli_json("cache", "list", "--where", "local", "--cache-dir", b)["local"]] == [
        keys[1]
    ]
    assert leftovers(b) == []

    # same size, different bytes: the sha256 catches it; and an export-time pull rejects it too
    n = (a / "compile" / NS / keys[0] / "model.pt2").stat().st_size
    remote.corrupt(f"compile/{NS}/{keys[0]}/model.pt2", b"\x01" * n)
    warnings = []
    cache = RemoteCache(tmp_path / "c", open_remote(remote.url), warn=warnings.append)
    meta = json.loads((a / "compile" / NS / keys[0] / "meta.json").read_text())
    found = cache.get(NS, keys[0], meta["parts"])
    assert found.path is None and "remote copy rejected (model.pt2 sha256 mismatch)" in found.reason
    assert len(warnings) == 1 and "rejected" in warnings[0]
    assert not cache.entry_dir(NS, keys[0]).exists() and leftovers(tmp_path / "c") == []


def test_remote_meta_must_match_its_key(tmp_path, request):
    remote = _make_remote("file", request, tmp_path)
    a, b = tmp_path / "a", tmp_path / "b"
    keys = make_entries(a, 2)
    cli("cache", "push", "--remote", remote.url, "--cache-dir", a, "-q")
    meta1 = remote.raw_path(f"compile/{NS}/{keys[1]}/meta.json").read_bytes()
    remote.corrupt(f"compile/{NS}/{keys[0]}/meta.json", meta1)  # entry 0 now claims to be entry 1
    res = cli_json("cache", "pull", "--remote", remote.url, "--cache-dir", b, code=1)
    assert res["rejected"] == [{"key": keys[0], "namespace": NS, "problem": "meta.json is for another key"}]
    meta0 = json.loads((a / "compile" / NS / keys[0] / "meta.json").read_text())
    cache = RemoteCache(tmp_path / "c", open_remote(remote.url), warn=lambda m: None)
    # the key parts an export asks for must be the ones the remote entry was built from
    found = cache.get(NS, keys[1], {**meta0["parts"], "i": 99})
    assert found.path is None and "key parts differ" in found.reason


def test_export_time_pull_is_a_hit_and_atomic(tmp_path, request):
    remote = _make_remote("s3", request, tmp_path)
    a = tmp_path / "a"
    keys = make_entries(a, 1)
    cli("cache", "push", "--remote", remote.url, "--cache-dir", a, "-q")
    meta = json.loads((a / "compile" / NS / keys[0] / "meta.json").read_text())
    cache = RemoteCache(tmp_path / "b", open_remote(remote.url))
    with cache.lock(NS, keys[0]):  # re-entrant: an export holds it around its second get()
        found = cache.get(NS, keys[0], meta["parts"])
    assert found.reason == f"pulled from remote {remote.url}" and verify_entry(found.path) is None
    assert cache.get(NS, keys[0], meta["parts"]).reason == "hit"
    miss = cache.get(NS, "d" * 64, {"bucket": "context-16"})
    assert miss.path is None and miss.reason.endswith(f"; not on remote {remote.url}")


# -- unreachable remotes --------------------------------------------------------------------


def test_unreachable_remote_degrades_to_local_compile(tmp_path, caplog):
    cache = RemoteCache(tmp_path / "c", open_remote(f"file://{tmp_path}/not-mounted"))
    with caplog.at_level(logging.WARNING, logger="nxdc.cache"):
        first = cache.get(NS, "a" * 64, {"bucket": "context-16"})
        second = cache.get(NS, "b" * 64, {"bucket": "context-32"})
    assert first.path is None and first.reason == "no entry for this graph; remote unreachable"
    assert second.reason == "no entry for this graph; remote unreachable"
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "is it mounted?" in warnings[0]  # once, not per graph

    strict = RemoteCache(tmp_path / "c", open_remote(f"file://{tmp_path}/not-mounted"), require=True)
    with pytest.raises(CacheError, match="--require-cache"):
        strict.get(NS, "a" * 64, {"bucket": "context-16"})


@pytest.mark.parametrize(
    "url, needle",
    [
        ("file:///nonexistent/nxdc-remote", "does not exist (is it mounted?)"),
        (f"s3://no-such-bucket-{uuid.uuid4().hex[:6]}/x", "bucket 'no-such-bucket-"),
    ],
)
def test_cache_commands_fail_in_one_line_when_unreachable(url, needle, tmp_path, request):
    if url.startswith("s3"):
        request.getfixturevalue("s3_server")
    make_entries(tmp_path / "a", 1)
    for cmd in ("push", "pull", "sync"):
        res = cli("cache", cmd, "--remote", url, "--cache-dir", tmp_path / "a", code=1)
        assert needle in res.stderr
    assert (
        needle
        in cli("cache", "list", "--where", "remote", "--remote", url, "--cache-dir", tmp_path, code=1).stderr
    )


def test_s3_endpoint_down(tmp_path, monkeypatch, s3_server):
    monkeypatch.setenv("NXDC_S3_ENDPOINT_URL", f"http://127.0.0.1:{_free_port()}")
    res = cli("cache", "push", "--remote", f"s3://{BUCKET}/x", "--cache-dir", tmp_path, code=1)
    assert "cannot list compile" in res.stderr and "EndpointConnectionError" in res.stderr


def test_real_hub_api_offline_is_unreachable(tmp_path, monkeypatch):
    """The real HfApi (no fake) with HF_HUB_OFFLINE=1, as the test session runs: every
    operation becomes one clear 'cannot reach the Hub' error."""
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    make_entries(tmp_path / "a", 1)
    for cmd in ("push", "pull"):
        res = cli("cache", cmd, "--remote", "hf://test-org/nxdc-cache", "--cache-dir", tmp_path / "a", code=1)
        assert "cannot reach the Hub" in res.stderr
    hub = open_remote("hf://datasets/test-org/nxdc-cache@main")
    assert (hub.repo_id, hub.repo_type, hub.revision) == ("test-org/nxdc-cache", "dataset", "main")
    cache = RemoteCache(tmp_path / "c", hub, warn=lambda m: None)
    assert cache.get(NS, "a" * 64, {"bucket": "context-16"}).reason.endswith("remote unreachable")


# -- configuration ------------------------------------------------------------------------


def test_set_remote_env_and_flag_precedence(tmp_path, monkeypatch):
    c = tmp_path / "c"
    one, two, three = (tmp_path / n for n in ("one", "two", "three"))
    for d in (one, two, three):
        d.mkdir()
    assert cli_json("cache", "set-remote", "--cache-dir", c) == {"remote": None, "source": None}
    res = cli_json("cache", "set-remote", f"file://{one}", "--cache-dir", c)
    assert res == {"remote": f"file://{one}", "source": str(c / "config.json")}
    make_entries(c, 1)
    assert cli_json("cache", "push", "--cache-dir", c)["remote"] == f"file://{one}"
    monkeypatch.setenv("NXDC_CACHE_REMOTE", f"file://{two}")
    assert cli_json("cache", "push", "--cache-dir", c)["remote"] == f"file://{two}"
    assert (
        cli_json("cache", "push", "--remote", f"file://{three}", "--cache-dir", c)["remote"]
        == f"file://{three}"
    )
    assert all(len(list((d / "compile").rglob("meta.json"))) == 1 for d in (one, two, three))
    monkeypatch.delenv("NXDC_CACHE_REMOTE")
    assert cli_json("cache", "set-remote", "--clear", "--cache-dir", c)["remote"] is None
    assert "no remote configured" in cli("cache", "push", "--cache-dir", c, code=2).stderr


@pytest.mark.parametrize(
    "url, needle",
    [
        ("http://example.com/x", "unsupported URL"),
        ("file://relative/path", "three slashes"),
        ("hf://just-a-name", "expected hf://org/name"),
        ("s3://", "expected s3://bucket"),
    ],
)
def test_bad_remote_urls(url, needle, tmp_path):
    assert needle in cli("cache", "set-remote", url, "--cache-dir", tmp_path, code=2).stderr
    assert not (tmp_path / "config.json").exists()


def test_remote_names_cannot_escape_the_cache():
    from nxdc.sync.remotes.base import RemoteCorrupt, safe_path

    for ok in ("compile/inductor-cuda-2.13.0+cu128-(9,0)/" + "a" * 64 + "/model.pt2", "registry/ab/cd.json"):
        assert safe_path(ok) == ok
    for bad in ("../x", "compile/../../etc/passwd", "/abs", "compile//x", "compile/.hidden", ""):
        with pytest.raises(RemoteCorrupt):
            safe_path(bad)


def test_size_and_age_parsing():
    assert (
        parse_size("5GB") == 5 * 10**9 and parse_size("500MiB") == 500 * 2**20 and parse_size("1024") == 1024
    )
    assert parse_age("30d") == 30 * 86400 and parse_age("12h") == 12 * 3600 and parse_age("2w") == 14 * 86400
    for bad in ("5 parsecs", "-1GB"):
        with pytest.raises(UserInputError, match="--max-size"):
            parse_size(bad)
    with pytest.raises(UserInputError, match="--older-than"):
        parse_age("30")


# -- verify / prune ---------------------------------------------------------------------------


def test_verify_reports_and_discards_corrupt_entries(tmp_path):
    c = tmp_path / "c"
    keys = make_entries(c, 3)
    assert cli_json("cache", "verify", "--cache-dir", c) == {"checked": 3, "ok": 3, "corrupt": []}
    with open(c / "compile" / NS / keys[1] / "model.pt2", "r+b") as f:
        f.seek(100)
        f.write(b"\x00bitrot\x00")
    (c / "compile" / NS / keys[2] / "model.pt2").unlink()
    res = cli_json("cache", "verify", "--keep", "--cache-dir", c, code=1)
    assert {x["key"]: x["problem"] for x in res["corrupt"]} == {
        keys[1]: "model.pt2 sha256 mismatch",
        keys[2]: "model.pt2 missing",
    }
    assert (c / "compile" / NS / keys[1]).is_dir()  # --keep
    res = cli("cache", "verify", "--cache-dir", c, code=1)
    assert "2 corrupt" in res.stderr and "discarded" in res.stderr
    assert sorted(p.name for p in (c / "compile" / NS).iterdir() if not p.name.startswith(".")) == [keys[0]]
    assert cli_json("cache", "verify", "--cache-dir", c)["corrupt"] == []


def _age(root: Path, key: str, days: float) -> None:
    """Make an entry look created and last used ``days`` ago."""
    meta_path = root / "compile" / NS / key / "meta.json"
    meta = json.loads(meta_path.read_text())
    meta["created"] = time.time() - days * 86400
    meta_path.write_text(json.dumps(meta))
    os.utime(meta_path, (meta["created"], meta["created"]))


def test_prune_by_age_then_size(tmp_path):
    c = tmp_path / "c"
    keys = make_entries(c, 4)
    for key, days in zip(keys, (40, 35, 3, 1), strict=True):
        _age(c, key, days)
    res = cli_json("cache", "prune", "--older-than", "30d", "--dry-run", "--cache-dir", c)
    assert [r["key"] for r in res["removed"]] == keys[:2] and len(entry_files(c)) == 8
    res = cli_json("cache", "prune", "--older-than", "30d", "--cache-dir", c)
    assert [(r["key"], r["why"]) for r in res["removed"]] == [(keys[0], "age"), (keys[1], "age")]
    left = {e["key"]: e["bytes"] for e in cli_json("cache", "list", "--cache-dir", c)["local"]}
    assert set(left) == set(keys[2:])
    # keep at most one entry's worth: the least recently used goes first
    res = cli_json("cache", "prune", "--max-size", str(left[keys[3]]), "--cache-dir", c)
    assert [(r["key"], r["why"]) for r in res["removed"]] == [(keys[2], "size")]
    assert res["bytes_kept"] == left[keys[3]]
    # a cache hit counts as use: an old entry that was just used survives --older-than
    _age(c, keys[3], 60)
    cache = RemoteCache(c)
    meta = json.loads((c / "compile" / NS / keys[3] / "meta.json").read_text())
    assert cache.get(NS, keys[3], meta["parts"]).reason == "hit"
    assert cli_json("cache", "prune", "--older-than", "30d", "--cache-dir", c)["removed"] == []
    assert "give --older-than" in cli("cache", "prune", "--cache-dir", c, code=2).stderr
    assert "--older-than" in cli("cache", "prune", "--older-than", "soon", "--cache-dir", c, code=2).stderr


def test_prune_skips_entries_in_use(tmp_path):
    c = tmp_path / "c"
    keys = make_entries(c, 2)
    held = CompileCache(c).lock(NS, keys[0])
    with held:  # another process is compiling or pulling this key
        res = subprocess.run(
            [sys.executable, "-m", "nxdc.cli.main", "cache", "prune", "--max-size", "0", "--json"],
            env={**os.environ, "NXDC_CACHE_DIR": str(c)},
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert [r["key"] for r in out["busy"]] == [keys[0]] and [r["key"] for r in out["removed"]] == [keys[1]]


def test_concurrent_pulls_into_one_cache(tmp_path, request):
    """Two `nxdc cache pull` processes on one empty cache: each entry is downloaded once,
    nothing is corrupted (then `nxdc cache verify` passes), no temp dirs are left."""
    remote = _make_remote("file", request, tmp_path)
    keys = make_entries(tmp_path / "a", 4)
    cli("cache", "push", "--remote", remote.url, "--cache-dir", tmp_path / "a", "-q")
    env = {**os.environ, "NXDC_CACHE_DIR": str(tmp_path / "b")}
    cmd = [sys.executable, "-m", "nxdc.cli.main", "cache"]
    procs = [
        subprocess.Popen(
            [*cmd, "pull", "--remote", remote.url, "--json"],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    results = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [r[1] for r in results]
    pulled = [json.loads(out) for out, _ in results]
    assert sorted(k for p in pulled for k in p["downloaded"]) == sorted(keys)
    assert sum(p["present"] for p in pulled) == len(keys)
    res = subprocess.run([*cmd, "verify", "--json"], env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and json.loads(res.stdout) == {"checked": 4, "ok": 4, "corrupt": []}, (
        res.stderr
    )
    assert entry_files(tmp_path / "b") == entry_files(tmp_path / "a") and leftovers(tmp_path / "b") == []


# -- real exports (compiled once per session by the shared fixtures) -----------------------------


def gqa_flags():
    return [
        "--batch-size",
        GQA_EXPORT["batch_size"],
        "--sequence-length",
        GQA_EXPORT["sequence_length"],
        "--context-buckets",
        ",".join(map(str, GQA_EXPORT["context_buckets"])),
        "--decode-buckets",
        ",".join(map(str, GQA_EXPORT["decode_buckets"])),
    ]


def artifact_keys(export_dir: Path) -> dict[str, str]:
    return {n: a["key"] for n, a in json.loads((export_dir / "nxdc.json").read_text())["artifacts"].items()}


def kernel_key(cache_dir: Path) -> str:
    """The key of this nxdc's kernel library entry, put into ``cache_dir`` (from the library
    this process runs) if it is not there yet: the graphs of these exports call it."""
    import shutil

    from nxdc.kernels import LIBRARY, ensure_loaded, kernel_entry, loaded_library

    assert ensure_loaded()
    ns, key, parts = kernel_entry()
    cache = CompileCache(cache_dir)
    if cache.get(ns, key, parts).path is None:
        src = cache_dir.parent / f".kernels-{uuid.uuid4().hex}"
        src.mkdir()
        shutil.copy2(loaded_library()[1], src / LIBRARY)
        cache.put(ns, key, parts, src)
        src.rmdir()
    return key


@pytest.fixture
def no_compile(monkeypatch):
    from nxdc.compile.backends.inductor import InductorBackend

    def refuse(*a, **k):
        raise AssertionError("compile called although the remote has every graph")

    monkeypatch.setattr(InductorBackend, "compile", refuse)


@pytest.mark.slow
def test_machine_b_exports_with_zero_compiles(
    remote, tiny_gqa, tiny_gqa_export, cache_dir, tmp_path, request
):
    keys = artifact_keys(tiny_gqa_export)
    # machine A: the session cache, where the fixture exported (and recorded) this plan
    key_flags = [f for k in keys.values() for f in ("--key", k)]
    up = cli_json("cache", "push", *key_flags, "--remote", remote.url, "--cache-dir", cache_dir)
    assert sorted(up["uploaded"]) == sorted(keys.values()) and up["records"] >= 1

    # machine B: an empty cache, the same remote; compiling is forbidden
    request.getfixturevalue("no_compile")
    b = tmp_path / "b"
    lookup = cli_json("cache", "lookup", tiny_gqa, "--remote", remote.url, "--cache-dir", b)
    config = next(c for c in lookup["configs"] if set(c["buckets"]) == set(keys))
    assert (config["batch_size"], config["sequence_length"], config["dtype"], config["tp"]) == (
        2,
        64,
        "fp32",
        1,
    )
    assert (config["local"], config["remote"], config["usable_here"]) == ("none", "complete", True)
    assert (config["weights"], config["kv_cache"], config["unusable_reason"]) == ("fp32", "fp32", None)

    out = tmp_path / "out"
    res = cli("export", tiny_gqa, "-o", out, *gqa_flags(), "--remote", remote.url, "--cache-dir", b, "--json")
    summary = json.loads(res.stdout)
    assert summary["compiled"] == 0 and summary["cache_hits"] == 4
    assert {x["reason"] for x in summary["buckets"]} == {f"pulled from remote {remote.url}"}
    a_art = json.loads((tiny_gqa_export / "nxdc.json").read_text())["artifacts"]
    b_art = json.loads((out / "nxdc.json").read_text())["artifacts"]
    assert {n: x["files"] for n, x in a_art.items()} == {n: x["files"] for n, x in b_art.items()}
    assert cli_json("cache", "verify", "--cache-dir", b)["ok"] == 4

    # B's own registry now records the export: lookup answers locally too
    lookup = cli_json("cache", "lookup", tiny_gqa, "--remote", remote.url, "--cache-dir", b)
    config = next(c for c in lookup["configs"] if set(c["buckets"]) == set(keys))
    assert (config["local"], config["remote"]) == ("complete", "complete")
    if remote.kind == "file":  # the human table, once
        table = cli("cache", "lookup", tiny_gqa, "--remote", remote.url, "--cache-dir", b).stdout
        assert "complete" in table and "fp32" in table and "yes" in table


@pytest.mark.slow
def test_pull_plan_then_export_offline(tiny_gqa, tiny_gqa_export, cache_dir, tmp_path, request, no_compile):
    """`nxdc cache pull MODEL [options]` fetches exactly the graphs that export needs; the
    export then runs with no remote at all."""
    remote = _make_remote("file", request, tmp_path)
    keys = {**artifact_keys(tiny_gqa_export), "kernels": kernel_key(cache_dir)}
    cli(
        "cache",
        "push",
        *[f for k in keys.values() for f in ("--key", k)],
        "--remote",
        remote.url,
        "--cache-dir",
        cache_dir,
        "-q",
    )
    b = tmp_path / "b"
    res = cli_json("cache", "pull", tiny_gqa, *gqa_flags(), "--remote", remote.url, "--cache-dir", b)
    assert sorted(res["downloaded"]) == sorted(keys.values()) and res["missing"] == [] and res["records"] >= 1
    other = cli_json(
        "cache", "pull", tiny_gqa, "--sequence-length", "32", "--remote", remote.url, "--cache-dir", b
    )
    assert other["downloaded"] == [] and len(other["missing"]) >= 1  # a plan nobody exported
    summary = json.loads(
        cli("export", tiny_gqa, "-o", tmp_path / "out", *gqa_flags(), "--cache-dir", b, "--json").stdout
    )
    assert summary["compiled"] == 0 and {x["reason"] for x in summary["buckets"]} == {"hit"}


@pytest.mark.slow
def test_machine_b_without_a_compiler_pulls_the_kernels(
    tiny_gqa, tiny_gqa_export, cache_dir, tmp_path, request
):
    """Machine A pushes its graphs and kernel library; machine B (a fresh process, an empty cache,
    and a C/C++ compiler that always fails) exports the same plan building nothing, and its
    export generates A's greedy tokens. Without the kernels on the remote, --require-cache on B is
    a one-line error instead of a build."""
    import subprocess
    import sys

    remote = _make_remote("file", request, tmp_path)
    keys = {**artifact_keys(tiny_gqa_export), "kernels": kernel_key(cache_dir)}
    graphs_only = [f for n, k in keys.items() if n != "kernels" for f in ("--key", k)]
    cli("cache", "push", *graphs_only, "--remote", remote.url, "--cache-dir", cache_dir, "-q")
    broken = tmp_path / "no-compiler"
    broken.write_text("#!/bin/sh\necho 'no compiler on machine B' >&2\nexit 1\n")
    broken.chmod(0o755)
    env = {**os.environ, "CC": str(broken), "CXX": str(broken), "NXDC_CACHE_DIR": str(tmp_path / "b")}
    nxdc = [sys.executable, "-m", "nxdc.cli.main"]

    def export_on_b(out: Path, *flags: str):
        cmd = [*nxdc, "export", str(tiny_gqa), "-o", str(out), *map(str, gqa_flags()), "--remote", remote.url]
        return subprocess.run([*cmd, *flags], env=env, capture_output=True, text=True, timeout=600)

    refused = export_on_b(tmp_path / "refused", "--require-cache")
    assert refused.returncode == 1, refused.stderr
    assert "nxdc's CPU kernels are neither in the local cache nor on the remote" in refused.stderr
    assert "Traceback" not in refused.stderr and not (tmp_path / "refused").exists()

    cli("cache", "push", "--key", keys["kernels"], "--remote", remote.url, "--cache-dir", cache_dir, "-q")
    lookup = cli_json("cache", "lookup", tiny_gqa, "--remote", remote.url, "--cache-dir", tmp_path / "b")
    config = next(c for c in lookup["configs"] if set(c["buckets"]) == set(keys) - {"kernels"})
    assert config["kernels"] == {"key": keys["kernels"], "local": "none", "remote": "complete"}
    table = cli("cache", "lookup", tiny_gqa, "--remote", remote.url, "--cache-dir", tmp_path / "b").stdout
    assert f"nxdc CPU kernels {keys['kernels'][:12]}: remote" in table
    res = export_on_b(tmp_path / "out", "--json")
    assert res.returncode == 0, res.stderr
    summary = json.loads(res.stdout)
    assert summary["compiled"] == 0 and {b["reason"] for b in summary["buckets"]} == {
        f"pulled from remote {remote.url}"
    }
    b_kernels = CompileCache(tmp_path / "b").entry_dir(*_kernel_ns_key()) / "meta.json"
    assert b_kernels.is_file()  # pulled and cached on B, verified
    gen = [*nxdc, "generate", "-p", "w5 w6 w7 w8", "-n", "12", "--json"]
    a = subprocess.run([*gen[:4], str(tiny_gqa_export), *gen[4:]], capture_output=True, text=True, env=env)
    b = subprocess.run([*gen[:4], str(tmp_path / "out"), *gen[4:]], capture_output=True, text=True, env=env)
    assert a.returncode == 0 and b.returncode == 0, a.stderr + b.stderr
    ids = lambda r: json.loads(r.stdout)["results"][0]["token_ids"]  # noqa: E731
    assert ids(a) == ids(b) and len(ids(a)) == 12


def _kernel_ns_key() -> tuple[str, str]:
    from nxdc.kernels import kernel_entry

    ns, key, _ = kernel_entry()
    return ns, key


@pytest.mark.slow
def test_corrupt_remote_graph_is_compiled_locally(tiny_gqa, tiny_gqa_export, cache_dir, tmp_path, request):
    remote = _make_remote("file", request, tmp_path)
    keys = artifact_keys(tiny_gqa_export)
    cli(
        "cache",
        "push",
        *[f for k in keys.values() for f in ("--key", k)],
        "--remote",
        remote.url,
        "--cache-dir",
        cache_dir,
        "-q",
    )
    entry = next(Path(remote.url[len("file://") :]).glob(f"compile/*/{keys['decode-64']}"))
    with open(entry / "model.pt2", "r+b") as f:
        f.seek(1000)
        f.write(b"\x00garbage\x00")
    c = tmp_path / "c"
    res = cli(
        "export",
        tiny_gqa,
        "-o",
        tmp_path / "out",
        *gqa_flags(),
        "--remote",
        remote.url,
        "--cache-dir",
        c,
        "--json",
    )
    by_name = {x["name"]: x for x in json.loads(res.stdout)["buckets"]}
    assert not by_name["decode-64"]["hit"]
    assert "remote copy rejected (model.pt2 sha256 mismatch)" in by_name["decode-64"]["reason"]
    assert all(
        by_name[n]["reason"].startswith("pulled from remote")
        for n in ("context-16", "context-32", "decode-32")
    )
    assert "warning:" in res.stderr and "rejected" in res.stderr
    # the locally compiled graph replaced nothing on the remote, and the local cache is sound
    assert cli_json("cache", "verify", "--cache-dir", c)["ok"] == 4


@pytest.mark.slow
def test_export_with_unreachable_remote(tiny_gqa, tmp_path, monkeypatch):
    """Without --require-cache: one warning line, then local compiles (stubbed here: the
    graphs are traced but the compiler writes a placeholder). With it: a clear error, exit 1."""
    from nxdc.compile.backends.inductor import InductorBackend

    def placeholder(self, ep, out_dir, kind=None):
        (out_dir / "model.pt2").write_bytes(b"placeholder")

    monkeypatch.setattr(InductorBackend, "compile", placeholder)
    url = f"file://{tmp_path}/not-mounted"
    flags = ["--sequence-length", "32", "--context-buckets", "16", "--decode-buckets", "32"]
    res = cli(
        "export",
        tiny_gqa,
        "-o",
        tmp_path / "out",
        *flags,
        "--remote",
        url,
        "--cache-dir",
        tmp_path / "c",
        "--json",
    )
    summary = json.loads(res.stdout)
    assert summary["compiled"] == 2
    assert [x["reason"] for x in summary["buckets"]] == ["no entry for this graph; remote unreachable"] * 2
    warnings = [line for line in res.stderr.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "is it mounted?" in warnings[0], res.stderr

    strict = [*flags, "--remote", url, "--cache-dir", tmp_path / "d", "--require-cache"]
    res = cli("export", tiny_gqa, "-o", tmp_path / "out2", *strict, code=1)
    assert "--require-cache" in res.stderr and "does not exist" in res.stderr
    assert not (tmp_path / "out2").exists()
    res = cli(
        "export",
        tiny_gqa,
        "-o",
        tmp_path / "out3",
        *flags,
        "--cache-dir",
        tmp_path / "d",
        "--require-cache",
        code=2,
    )
    assert "--require-cache needs a remote" in res.stderr


def test_lookup_says_why_a_record_is_not_usable_here():
    from nxdc.cache.keys import model_code_digest
    from nxdc.kernels import kernel_digest
    from nxdc.sync.registry import current_namespace, unusable_reason

    plan = {"backend": "inductor", "device": "cpu"}
    here = current_namespace(plan)
    rec = {"code": model_code_digest(), "kernels": kernel_digest(), "namespace": here, "plan": plan}
    assert unusable_reason(rec) is None
    assert unusable_reason({**rec, "kernels": None}) is None  # graphs without nxdc's kernels
    assert unusable_reason({**rec, "code": "0" * 16}) == "other nxdc model code"
    assert unusable_reason({**rec, "kernels": "0" * 16}) == "other nxdc kernels"
    other = "inductor-cpu-1.0.0-avx2"
    assert unusable_reason({**rec, "namespace": other}) == f"built for {other}, this machine is {here}"
    unknown = {"backend": "no-such-backend", "device": "cpu"}
    assert unusable_reason({**rec, "plan": unknown}) == "backend or device not available here"
