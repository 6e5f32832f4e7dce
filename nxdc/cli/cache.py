"""`nxdc cache ...`: the compile cache and its remotes (push, pull, sync, list, lookup,
verify, prune, set-remote). See docs/cache.md."""

from __future__ import annotations

import time
from pathlib import Path

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from nxdc.cli.common import CACHE_DIR, JSON, QUIET, VERBOSE, cli_errors, err_console, print_json
from nxdc.cli.export_options import export_flags
from nxdc.errors import UserInputError

app = typer.Typer(
    name="cache",
    help="The compile cache and its remotes (hf://org/name, file:///path, s3://bucket/prefix).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
out_console = Console(highlight=False, soft_wrap=True)

REMOTE = typer.Option(
    None, "--remote", help="Remote URL; default NXDC_CACHE_REMOTE, then `nxdc cache set-remote`."
)
KEYS = typer.Option(None, "--key", help="Only this cache key (repeatable).")


def say(msg: str) -> None:
    """One line on stderr, never wrapped (scripts grep these)."""
    err_console.print(msg, soft_wrap=True)


def _cache(cache_dir: Path | None):
    from nxdc.cache.store import CompileCache

    return CompileCache(cache_dir)


def _remote(cache, remote: str | None, required: bool = True):
    from nxdc.sync.remote_cache import resolve_remote

    return resolve_remote(cache, remote, required)


def _keys(keys: list[str] | None) -> set[str] | None:
    if not keys:
        return None
    from nxdc.sync.fetch import KEY

    bad = [k for k in keys if not KEY.match(k)]
    if bad:
        raise UserInputError(f"--key {bad[0]!r} is not a cache key (64 hex digits, see `nxdc cache list`)")
    return set(keys)


def size(n: int | None) -> str:
    if n is None:
        return "?"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def age(s: float | None) -> str:
    if s is None:
        return "?"
    for unit, span in (("d", 86400), ("h", 3600), ("m", 60)):
        if s >= span:
            return f"{s / span:.0f}{unit}"
    return f"{s:.0f}s"


def _transfer_line(verb: str, rep) -> str:
    moved = rep.uploaded if verb == "pushed" else rep.downloaded
    line = (
        f"{verb} {len(moved)} entries ({size(rep.bytes)}) and {rep.records} registry records "
        f"{'to' if verb == 'pushed' else 'from'} {escape(rep.remote)}; {rep.present} already there"
    )
    if rep.missing:
        line += f"; {len(rep.missing)} not found"
    if rep.rejected:
        line += f"; [red]{len(rep.rejected)} rejected[/] ({escape(rep.rejected[0]['problem'])})"
    return line


@app.command("set-remote")
@cli_errors
def set_remote(
    url: str = typer.Argument(None, help="hf://org/name, file:///path or s3://bucket/prefix"),
    clear: bool = typer.Option(False, "--clear", help="Forget the saved remote."),
    cache_dir: Path = CACHE_DIR,
    json_out: bool = JSON,
    quiet: bool = QUIET,
    verbose: bool = VERBOSE,
) -> None:
    """Save the remote every cache command and `nxdc export` use (in <cache>/config.json)."""
    from nxdc.sync.remotes import configured_remote, save_remote

    cache = _cache(cache_dir)
    if url and clear:
        raise UserInputError("give a URL or --clear, not both")
    if url or clear:
        save_remote(cache.root, None if clear else url)
    now, source = configured_remote(cache.root)
    if json_out:
        print_json({"remote": now, "source": source or None})
    elif not quiet:
        say(f"remote: {escape(now)} [dim]({escape(source)})[/]" if now else "no remote configured")


@app.command("push")
@cli_errors
def push(
    remote: str = REMOTE,
    keys: list[str] = KEYS,
    cache_dir: Path = CACHE_DIR,
    json_out: bool = JSON,
    quiet: bool = QUIET,
    verbose: bool = VERBOSE,
) -> None:
    """Upload the local entries (and registry records) the remote lacks; corrupt ones are not sent."""
    from nxdc.sync import transfer

    cache = _cache(cache_dir)
    rep = transfer.push(cache, _remote(cache, remote), _keys(keys))
    _finish("pushed", rep, json_out, quiet)


@app.command("pull")
@cli_errors
@export_flags
def pull(
    model: str = typer.Argument(None, help="Pull what `nxdc export MODEL` with these options needs."),
    keys: list[str] = KEYS,
    config: Path = typer.Option(None, "--config", help="TOML preset, as for export."),
    remote: str = REMOTE,
    cache_dir: Path = CACHE_DIR,
    json_out: bool = JSON,
    quiet: bool = QUIET,
    verbose: bool = VERBOSE,
    **options,  # the export options (nxdc/cli/export_options.py); None: not given
) -> None:
    """Download verified entries: those an export of MODEL needs, the --key ones, or (no MODEL, no --key) everything on the remote."""
    from nxdc.api.export import export_options
    from nxdc.compile.backends.registry import get_backend
    from nxdc.compile.graph_keys import graph_entries
    from nxdc.pipeline import prepare
    from nxdc.sync import transfer

    cache = _cache(cache_dir)
    rem = _remote(cache, remote)
    want_keys = _keys(keys)
    if (config or any(v is not None for v in options.values())) and not model:
        raise UserInputError("export options need a MODEL: nxdc cache pull MODEL [options]")
    if model and want_keys:
        raise UserInputError("give a MODEL or --key, not both")
    if model:
        _, _, spec, plan = prepare(model, export_options(config, **options)[1], cache.root)
        wanted = graph_entries(spec, plan, get_backend(plan.backend, plan.device))
        rep = transfer.pull(cache, rem, wanted=wanted, model_digest=spec.digest())
    else:
        rep = transfer.pull(cache, rem, keys=want_keys)
    _finish("pulled", rep, json_out, quiet, missing_is_error=want_keys is not None)


@app.command("sync")
@cli_errors
def sync(
    remote: str = REMOTE,
    cache_dir: Path = CACHE_DIR,
    json_out: bool = JSON,
    quiet: bool = QUIET,
    verbose: bool = VERBOSE,
) -> None:
    """Push what the remote lacks, then pull what the local cache lacks."""
    from nxdc.sync import transfer

    cache = _cache(cache_dir)
    rem = _remote(cache, remote)
    up = transfer.push(cache, rem)
    down = transfer.pull(cache, rem)
    if json_out:
        print_json({"push": up.to_dict(), "pull": down.to_dict()})
    elif not quiet:
        say(_transfer_line("pushed", up))
        say(_transfer_line("pulled", down))
    if up.rejected:
        _rejected_error("pushed", up.rejected)
    if down.rejected:
        _rejected_error("pulled", down.rejected)


def _finish(verb: str, rep, json_out: bool, quiet: bool, missing_is_error: bool = False) -> None:
    if json_out:
        print_json(rep.to_dict())
    elif not quiet:
        say(_transfer_line(verb, rep))
        if rep.missing and verb == "pulled" and not missing_is_error:
            say(f"[dim]{len(rep.missing)} graphs are not on the remote; an export compiles them[/]")
    if rep.rejected:  # the one error line goes to stderr in every mode; stdout stays JSON
        _rejected_error(verb, rep.rejected)
    if missing_is_error and rep.missing:
        say(f"[red]error:[/] not found on {escape(rep.remote)}: {', '.join(k[:16] for k in rep.missing)}")
        raise typer.Exit(1)


def _rejected_error(verb: str, rejected: list[dict]) -> None:
    first = rejected[0]
    say(
        f"[red]error:[/] {len(rejected)} corrupt entries were not {verb} "
        f"(first: {first['key'][:16]}: {escape(first['problem'])})"
    )
    raise typer.Exit(1)


@app.command("list")
@cli_errors
def list_(
    where: str = typer.Option(
        None, "--where", help="local | remote | all. \\[default: local, plus the remote if one is configured]"
    ),
    remote: str = REMOTE,
    cache_dir: Path = CACHE_DIR,
    json_out: bool = JSON,
    quiet: bool = QUIET,
    verbose: bool = VERBOSE,
) -> None:
    """Entries with their size and age, locally and/or on the remote."""
    from nxdc.sync import maintenance
    from nxdc.sync.remotes import RemoteUnavailable

    if where not in (None, "local", "remote", "all"):
        raise UserInputError(f"--where must be local, remote or all (got {where!r})")
    cache = _cache(cache_dir)
    now = time.time()
    result: dict = {}
    if where in (None, "local", "all"):
        result["local"] = maintenance.list_local(cache, now)
    if where in (None, "remote", "all"):
        rem = _remote(cache, remote, required=where is not None)
        if rem is not None:
            try:
                result["remote"] = maintenance.list_remote(rem, now)
                result["remote_url"] = rem.url
            except RemoteUnavailable as e:
                if where is not None:
                    raise
                say(f"[yellow]warning:[/] {escape(str(e))}")
    if json_out:
        print_json(result)
        return
    if quiet:
        return
    for side in ("local", "remote"):
        if side not in result:
            continue
        rows = result[side]
        title = escape(f"{side}: {cache.root if side == 'local' else result['remote_url']}")
        t = Table(title=title, title_justify="left", box=None, pad_edge=False)
        for col in ("key", "namespace", *(("bucket",) if side == "local" else ()), "size", "age"):
            t.add_column(col, justify="right" if col in ("size", "age") else "left")
        for e in rows:
            cells = [e["key"][:16], e["namespace"]]
            if side == "local":
                cells.append(e["bucket"] or "?")
            t.add_row(*cells, size(e["bytes"]), age(e["age_s"]))
        out_console.print(t)
        out_console.print(f"{len(rows)} entries, {size(sum(e['bytes'] for e in rows))}\n")


@app.command("lookup")
@cli_errors
def lookup(
    model: str = typer.Argument(..., help="Local HF dir, .gguf file, Hub id, or 'smollm2-135m'."),
    remote: str = REMOTE,
    cache_dir: Path = CACHE_DIR,
    json_out: bool = JSON,
    quiet: bool = QUIET,
    verbose: bool = VERBOSE,
) -> None:
    """Which export configurations of MODEL have every graph cached, locally and on the remote (from the registry exports write; nothing is traced)."""
    from nxdc.archs import spec_from_config
    from nxdc.sync import lookup
    from nxdc.weights.sources import resolve

    cache = _cache(cache_dir)
    rem = _remote(cache, remote, required=False)
    spec = spec_from_config(resolve(model, cache.root).config())
    res = lookup.lookup(cache, spec.digest(), rem)
    res["model"] = model
    if json_out:
        print_json(res)
        return
    if quiet:
        return
    if res["remote_error"]:
        say(f"[yellow]warning:[/] {escape(res['remote_error'])}")
    if not res["configs"]:
        out_console.print(
            f"no recorded exports of {escape(model)} ({spec.arch}, model digest {spec.digest()})"
        )
        return
    t = Table(
        title=f"{escape(model)} ({spec.arch}, model digest {spec.digest()})", title_justify="left", box=None
    )
    cols = ["tp", "batch", "seq", "dtype", "backend", "torch", "graphs", "local"]
    if rem is not None:
        cols.append("remote")
    for c in [*cols, "usable here"]:
        t.add_column(c, overflow="fold")  # a narrow terminal wraps values, never cuts them to "…"
    for r in res["configs"]:
        cells = [
            str(r["tp"]),
            str(r["batch_size"]),
            str(r["sequence_length"]),
            _formats(r),
            f"{r['backend']}/{r['device']}",
            str(r["torch"]),
            str(r["graphs"]),
            r["local"],
        ]
        if rem is not None:
            cells.append(r["remote"] or "?")
        t.add_row(*cells, "yes" if r["usable_here"] else f"no: {r['unusable_reason']}")
    out_console.print(t)
    kernels = next((r["kernels"] for r in res["configs"] if r["kernels"]), None)
    if kernels is not None:  # one library for every configuration whose graphs call it
        out_console.print(_kernels(kernels))


def _kernels(k: dict) -> str:
    """Where the CPU kernel library the fp32 graphs call is."""
    where = [w for w in ("local", "remote") if k[w] == "complete"]
    state = " and ".join(where) if where else "in neither cache: an export builds it"
    return f"nxdc CPU kernels {k['key'][:12]}: {state}"


def _formats(r: dict) -> str:
    """The dtype, and the stored weight / KV-cache formats where they differ from it."""
    extra = [
        f"{what} {r[k]}" for what, k in (("weights", "weights"), ("KV", "kv_cache")) if r[k] != r["dtype"]
    ]
    return ", ".join([r["dtype"], *extra])


@app.command("verify")
@cli_errors
def verify(
    keep: bool = typer.Option(False, "--keep", help="Only report corrupt entries; do not discard them."),
    cache_dir: Path = CACHE_DIR,
    json_out: bool = JSON,
    quiet: bool = QUIET,
    verbose: bool = VERBOSE,
) -> None:
    """Re-hash every local entry against the sha256 in its meta.json; discard corrupt ones (exit 1 if there were any)."""
    from nxdc.sync import maintenance

    res = maintenance.verify_all(_cache(cache_dir), discard=not keep)
    if json_out:
        print_json(res)
    elif not quiet:
        for c in res["corrupt"]:
            what = "discarded" if c["discarded"] else "kept (--keep)"
            say(f"[red]corrupt[/] {c['namespace']}/{c['key'][:16]}: {escape(c['problem'])} — {what}")
        say(f"verified {res['checked']} entries: {res['ok']} ok, {len(res['corrupt'])} corrupt")
    if res["corrupt"]:
        what = "kept (--keep)" if keep else "discarded"
        say(f"[red]error:[/] {len(res['corrupt'])} corrupt entries, {what}")
        raise typer.Exit(1)


@app.command("prune")
@cli_errors
def prune(
    older_than: str = typer.Option(
        None, "--older-than", help="Remove entries unused for this long: 30d, 12h, 2w."
    ),
    max_size: str = typer.Option(
        None, "--max-size", help="Then remove least recently used down to: 5GB, 500MiB."
    ),
    dry_run: bool = typer.Option(False, "--dry-run", help="Say what would be removed; remove nothing."),
    cache_dir: Path = CACHE_DIR,
    json_out: bool = JSON,
    quiet: bool = QUIET,
    verbose: bool = VERBOSE,
) -> None:
    """Remove local entries by age and/or total size (the remote is never pruned)."""
    from nxdc.sync import maintenance

    if older_than is None and max_size is None:
        raise UserInputError("give --older-than AGE and/or --max-size SIZE")
    res = maintenance.prune(
        _cache(cache_dir),
        maintenance.parse_age(older_than) if older_than else None,
        maintenance.parse_size(max_size) if max_size else None,
        dry_run,
    )
    if json_out:
        print_json(res)
    elif not quiet:
        verb = "would remove" if dry_run else "removed"
        freed = sum(r["bytes"] for r in res["removed"])
        line = f"{verb} {len(res['removed'])} entries ({size(freed)}); {size(res['bytes_kept'])} kept"
        if res["busy"]:
            line += f"; {len(res['busy'])} in use, skipped"
        say(line)
