"""Shared CLI plumbing: the flags every command takes, one-line errors with exit codes, JSON
output, consoles."""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import sys
import traceback

import typer
from rich.console import Console
from rich.markup import escape

from nxdc.errors import NxdcError

err_console = Console(stderr=True, highlight=False)

# The common flags, declared once; a command takes them as ``json_out: bool = JSON`` etc.
JSON = typer.Option(False, "--json", help="Print the result as JSON on stdout.")
QUIET = typer.Option(False, "-q", "--quiet", help="No progress or summary lines; errors still print.")
VERBOSE = typer.Option(False, "-v", "--verbose", help="Tracebacks on errors.")
CACHE_DIR = typer.Option(None, "--cache-dir", envvar="NXDC_CACHE_DIR", help="Compile cache directory.")


def cli_errors(fn):
    """Bad input -> exit 2, failures -> exit 1, Ctrl-C -> 130; one line, no traceback
    unless --verbose (or NXDC_VERBOSE=1)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        verbose = kwargs.get("verbose") or _env_verbose()
        try:
            return fn(*args, **kwargs)
        except typer.Exit:
            raise
        except NxdcError as e:
            if verbose:
                traceback.print_exc()
            err_console.print(f"[red]error:[/] {escape(str(e))}", soft_wrap=True)
            raise typer.Exit(e.exit_code) from None
        except KeyboardInterrupt:
            err_console.print("[red]interrupted[/]: nothing half-written was kept")
            raise typer.Exit(130) from None
        except Exception as e:
            if verbose:
                traceback.print_exc()
            err_console.print(
                f"[red]error:[/] internal error: {type(e).__name__}: {escape(str(e))} (re-run with --verbose for the traceback)",
                soft_wrap=True,
            )
            raise typer.Exit(1) from None

    return wrapper


def _env_verbose() -> bool:
    import os

    return os.environ.get("NXDC_VERBOSE", "") not in ("", "0")


def print_json(obj) -> None:
    sys.stdout.write(json.dumps(obj, indent=2, default=str) + "\n")
    sys.stdout.flush()


@contextlib.contextmanager
def log_warnings():
    """What the library logs at WARNING and above (logger ``nxdc``: an unreachable cache remote,
    ...) as one ``warning:`` line each on stderr, in every output mode."""
    handler = _WarningLine(logging.WARNING)
    logger = logging.getLogger("nxdc")
    logger.addHandler(handler)
    try:
        yield
    finally:
        logger.removeHandler(handler)


class _WarningLine(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        err_console.print(f"[yellow]warning:[/] {escape(record.getMessage())}", soft_wrap=True)
