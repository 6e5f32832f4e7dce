"""``nxdc.export``: compile a model into an export directory from Python, with the options,
defaults, checks and one-line errors of ``nxdc export`` (which is a thin layer over it).

The export options are the fields of ``nxdc.plan.ExportOptions``; ``with_export_options`` lists
them in a function's signature (this module's ``export``, and the ``nxdc export`` and
``nxdc cache pull`` commands, whose Typer parameters are built the same way), so an option is
declared once, as its field."""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import os
import time
import typing
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from nxdc.compile.planning import plan_from_config
from nxdc.errors import UserInputError
from nxdc.plan import LIST_OPTIONS, ExportOptions, load_preset
from nxdc.progress import NullReporter, Reporter

if TYPE_CHECKING:
    from nxdc.pipeline import ExportResult

PathLike = str | os.PathLike


def with_export_options(parameter: Callable[[str, Any, Any], tuple[Any, Any]], after: str):
    """Decorate ``fn(..., after, ..., **options)`` so that its signature (what ``help()``,
    ``inspect`` and Typer read) lists every ExportOptions field, in field order, as a keyword
    parameter right after the parameter ``after``. ``parameter(name, type, default)`` gives each
    one's (annotation, default) from the field's; ``fn`` receives them in ``**options``."""

    def decorate(fn):
        sig = inspect.signature(fn)
        params = [p for p in sig.parameters.values() if p.kind is not p.VAR_KEYWORD]
        at = [p.name for p in params].index(after) + 1
        hints = typing.get_type_hints(ExportOptions)
        added = []
        for f in dataclasses.fields(ExportOptions):
            annotation, default = parameter(f.name, hints[f.name], f.default)
            added.append(
                inspect.Parameter(
                    f.name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=annotation
                )
            )
        rest = [p.replace(kind=p.KEYWORD_ONLY) for p in params[at:]]
        fn.__signature__ = sig.replace(parameters=[*params[:at], *added, *rest])
        return fn

    return decorate


def _as_declared(name: str, kind, default) -> tuple[Any, Any]:
    """A Python keyword: the field's type and default."""
    return kind, default


@with_export_options(_as_declared, after="out")
def export(
    model: PathLike | None = None,
    out: PathLike | None = None,
    *,
    config: PathLike | None = None,
    cache_dir: PathLike | None = None,
    remote: str | None = None,
    require_cache: bool = False,
    check_accuracy: bool = False,
    progress: Callable[[str], None] | Reporter | None = None,
    **options: Any,
) -> ExportResult:
    """Compile ``model`` into the export directory ``out`` (weights + one compiled graph per
    bucket), as ``nxdc export MODEL -o OUT`` does, and return what it did.

    ``model``: a local Hugging Face directory, a .gguf file, a Hub id (org/name) or
    ``"smollm2-135m"``; None: the ``config`` preset's. The keyword options are ``nxdc export``'s
    flags with underscores (``tp=2`` for ``--tp 2``; every field of ``nxdc.plan.ExportOptions``),
    with its defaults; a bucket list is a sequence of ints or a string such as ``"128,512"``;
    None means not given. ``config``: a TOML preset (configs/*.toml) that the options given
    override. ``cache_dir``: the compile cache (default ``NXDC_CACHE_DIR``, else the user cache);
    ``remote``, ``require_cache``: the cache remote to pull missing graphs from, and whether to
    fail rather than compile when it is unreachable (docs/cache.md). ``check_accuracy``: also
    measure the --weights / --kv-cache formats against fp32 (``ExportResult.accuracy``).

    Silent by default: ``progress`` is called with one line per stage and per graph (cache hit
    or compiled), or is a ``nxdc.progress.Reporter`` (the CLI's rich one). Warnings (an
    unreachable remote) go to the ``nxdc`` logger.

    Raises ``nxdc.errors.NxdcError`` (``UserInputError`` for bad options, an unknown option, a
    model that cannot be sharded or found) with the message ``nxdc export`` prints."""
    from nxdc.pipeline import run_export
    from nxdc.sync.remote_cache import open_cache

    preset_model, opts = export_options(config, **options)
    model = _model(model, preset_model)
    if out is None:
        raise UserInputError("missing -o/--output (the export directory to write)")
    if check_accuracy:
        _check_accuracy_options(opts)
    cache_root = Path(cache_dir) if cache_dir is not None else None
    cache = open_cache(cache_root, remote, require_cache)
    result = run_export(model, out, opts, cache=cache, reporter=_reporter(progress))
    if check_accuracy:
        from nxdc.accuracy import measure

        result.accuracy = measure(model, opts, cache_root=cache_root)
    return result


@with_export_options(_as_declared, after="model")
def plan_export(
    model: PathLike | None = None,
    *,
    config: PathLike | None = None,
    config_only: PathLike | None = None,
    cache_dir: PathLike | None = None,
    **options: Any,
) -> dict:
    """What ``nxdc export --dry-run`` reports (``nxdc.pipeline.plan_summary``): the plan, its
    sharding and memory, after every check ``export`` makes before reading weights. With
    ``config_only`` (a config.json; or a ``model`` that is one) the plan is made from that file
    alone, for another machine: no weights, no download, backend and device not checked here."""
    from nxdc.pipeline import plan_summary, prepare

    preset_model, opts = export_options(config, **options)
    model = model if model is not None else preset_model
    if config_only is None and model and str(model).endswith(".json") and Path(model).is_file():
        config_only = model
    if config_only is not None:
        model = str(model or config_only)
        _, spec, plan = plan_from_config(config_only, opts)
    else:
        model = _model(model, None)
        _, _, spec, plan = prepare(model, opts, Path(cache_dir) if cache_dir is not None else None)
    summary = plan_summary(model, spec, plan)
    summary["config_only"] = config_only is not None
    return summary


def export_options(config: PathLike | None = None, **options: Any) -> tuple[str | None, ExportOptions]:
    """The preset ``config``'s options (none without one) overridden by the ``options`` given
    (None: not given; a bucket list may be "128,512"), and the preset's model (or None)."""
    unknown = sorted(set(options) - ExportOptions.fields())
    if unknown:
        raise UserInputError(
            f"unknown export option{'s' if len(unknown) > 1 else ''} {', '.join(unknown)} "
            f"(known: {', '.join(f.name for f in dataclasses.fields(ExportOptions))})"
        )
    preset = load_preset(config) if config is not None else {}
    model = preset.pop("model", None)
    given = {k: _int_list(k, v) if k in LIST_OPTIONS else v for k, v in options.items() if v is not None}
    return model, ExportOptions(**{**preset, **given})


def _model(model: PathLike | None, preset_model: str | None) -> str:
    model = model if model is not None else preset_model
    if not model:
        raise UserInputError("missing MODEL (a directory, .gguf file, Hub id or smollm2-135m)")
    return str(model)


def _int_list(name: str, value) -> tuple[int, ...]:
    """A bucket list option: "128,512" (as typed on the command line) or a sequence of ints."""
    if not isinstance(value, str):
        return tuple(value)
    try:
        return tuple(int(x) for x in value.split(",") if x.strip())
    except ValueError:
        flag = f"--{name.replace('_', '-')}"
        raise UserInputError(f"{flag} must be comma-separated integers (got {value!r})") from None


def _check_accuracy_options(opts: ExportOptions) -> None:
    if opts.weights in (None, opts.dtype) and opts.kv_cache in (None, opts.dtype):
        raise UserInputError(
            "--check-accuracy measures --weights / --kv-cache formats against fp32: pass one of them"
        )
    if opts.dtype != "fp32":
        raise UserInputError(
            f"--check-accuracy compares against fp32 and needs --dtype fp32 (got {opts.dtype})"
        )


def _reporter(progress: Callable[[str], None] | Reporter | None) -> Reporter:
    if progress is None:
        return NullReporter()
    return progress if isinstance(progress, Reporter) else _Lines(progress)


class _Lines(Reporter):
    """Progress as plain lines: a stage's start and end, and each graph's cache hit or compile."""

    def __init__(self, say: Callable[[str], None]):
        self.say = say

    @contextlib.contextmanager
    def stage(self, name: str, total: int | None = None):
        t0 = time.perf_counter()
        self.say(f"{name}…")
        yield
        self.say(f"{name} done ({time.perf_counter() - t0:.1f}s)")

    def bucket_done(self, name: str, hit: bool, reason: str, seconds: float) -> None:
        what = "cache hit" if hit else f"cache miss ({reason.removesuffix(' → built')}), compiled"
        self.say(f"{name}: {what} ({seconds:.1f}s)")
