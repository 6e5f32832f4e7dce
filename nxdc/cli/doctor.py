"""`nxdc doctor`: which backends, devices and caches this host can use."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console
from rich.markup import escape

from nxdc.cli.common import CACHE_DIR, JSON, VERBOSE, cli_errors, print_json

out_console = Console(highlight=False, soft_wrap=True)


@cli_errors
def doctor(
    cache_dir: Path = CACHE_DIR,
    json_out: bool = JSON,
    verbose: bool = VERBOSE,
) -> None:
    """Report what this host can use: torch, CPU ISA, the CPU kernels' build state, each backend
    and device, the serve extra and the compile cache, one line each (builds and contacts nothing)."""
    from nxdc.doctor import as_json, checks

    results = checks(cache_dir)
    if json_out:
        print_json(as_json(results))
    else:
        for c in results:
            mark = "[green]ok[/]  " if c.ok else "[yellow]no[/]  "
            out_console.print(f"{mark}{c.name}: {escape(c.detail)}", soft_wrap=True, highlight=False)
