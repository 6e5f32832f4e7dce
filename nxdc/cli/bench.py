"""`nxdc bench EXPORT... [--batch-sizes] [--prompt-lengths] [--new-tokens] [--runs] [--compare transformers]`."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from nxdc.cli.common import QUIET, VERBOSE, cli_errors, err_console, print_json
from nxdc.errors import UserInputError


@cli_errors
def bench(
    exports: list[Path] = typer.Argument(..., help="Export directories (e.g. one per batch size)."),
    batch_sizes: str = typer.Option(
        None,
        "--batch-sizes",
        help="e.g. 1,4,8 (each <= the export's batch size). \\[default: each export's batch size]",
    ),
    prompt_lengths: str = typer.Option(
        "128", "--prompt-lengths", help="Prompt lengths in tokens, e.g. 128,512."
    ),
    new_tokens: int = typer.Option(128, "--new-tokens", help="Tokens generated per run (EOS ignored)."),
    runs: int = typer.Option(3, "--runs", help="Measured runs per configuration (medians reported)."),
    warmup: int = typer.Option(1, "--warmup", help="Unmeasured runs first."),
    compare: str = typer.Option(
        None, "--compare", help="'transformers': run HF eager generate too, interleaved."
    ),
    threads: int = typer.Option(None, "--threads"),
    json_file: Path = typer.Option(
        None, "--json", help="Write the full results (JSON) to this file ('-' = stdout)."
    ),
    plot_file: Path = typer.Option(None, "--plot", help="Write a PNG plot."),
    quiet: bool = QUIET,
    verbose: bool = VERBOSE,
) -> None:
    """Measure TTFT, inter-token latency, decode/prefill throughput, memory and the share of the
    memory-bandwidth roofline of one or more exports."""
    from nxdc.bench.report import plot, print_table
    from nxdc.bench.runner import run_bench

    result = run_bench(
        list(exports),
        _ints(batch_sizes, "--batch-sizes") if batch_sizes else None,
        _ints(prompt_lengths, "--prompt-lengths"),
        new_tokens,
        runs,
        warmup,
        compare,
        threads,
        progress=None if quiet else (lambda msg: err_console.print(f"[dim]bench {msg}[/]")),
    )
    if json_file is not None and str(json_file) == "-":
        print_json(result)
    elif json_file is not None:
        json_file.parent.mkdir(parents=True, exist_ok=True)
        tmp = json_file.with_suffix(json_file.suffix + ".tmp")
        tmp.write_text(json.dumps(result, indent=2))
        tmp.replace(json_file)
    if plot_file is not None:
        plot(result, plot_file)
    if not quiet and str(json_file) != "-":
        print_table(result, err_console)


def _ints(s: str, flag: str) -> list[int]:
    try:
        vals = [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        vals = []
    if not vals or min(vals) < 1:
        raise UserInputError(f"{flag} must be comma-separated positive integers (got {s!r})")
    return vals
