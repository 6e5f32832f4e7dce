"""`nxdc export MODEL -o OUT`."""

from __future__ import annotations

from pathlib import Path

import typer

from nxdc.cli.common import cli_errors, err_console, print_json
from nxdc.errors import UserInputError


@cli_errors
def export(
    model: str = typer.Argument(None, help="Local HF dir, .gguf file, Hub id (org/name), or 'smollm2-135m'."),
    output: Path = typer.Option(..., "-o", "--output", help="Export directory to write."),
    config: Path = typer.Option(None, "--config", help="TOML preset (configs/*.toml); flags override it."),
    tp: int = typer.Option(None, "--tp", help="Tensor-parallel degree. [default: 1]"),
    batch_size: int = typer.Option(None, "--batch-size", help="Static batch size. [default: 1]"),
    sequence_length: int = typer.Option(
        None,
        "--sequence-length",
        help="KV-cache length (prompt + new tokens). [default: min(1024, model max)]",
    ),
    max_context_length: int = typer.Option(
        None, "--max-context-length", help="Largest prompt bucket. [default: sequence length]"
    ),
    min_context_bucket: int = typer.Option(
        None, "--min-context-bucket", help="Smallest prompt bucket. [default: 128]"
    ),
    context_buckets: str = typer.Option(
        None, "--context-buckets", help="Explicit prompt buckets, e.g. 128,512."
    ),
    min_decode_bucket: int = typer.Option(
        None, "--min-decode-bucket", help="Smallest decode cache length. [default: 256]"
    ),
    decode_buckets: str = typer.Option(
        None, "--decode-buckets", help="Explicit decode cache lengths, e.g. 512,1024."
    ),
    dtype: str = typer.Option(None, "--dtype", help="fp32 | bf16. [default: fp32]"),
    backend: str = typer.Option(None, "--backend", help="inductor | neuron. [default: inductor]"),
    device: str = typer.Option(None, "--device", help="cpu | cuda[:N] (inductor backend). [default: cpu]"),
    cache_dir: Path = typer.Option(
        None, "--cache-dir", envvar="NXDC_CACHE_DIR", help="Compile cache directory."
    ),
    dry_run: bool = typer.Option(False, "--dry-run", help="Validate and print the plan; read no weights."),
    json_out: bool = typer.Option(False, "--json", help="Print a JSON summary on stdout."),
    quiet: bool = typer.Option(False, "-q", "--quiet", help="No progress output."),
    verbose: bool = typer.Option(False, "-v", "--verbose", help="Tracebacks on errors."),
) -> None:
    """Compile MODEL into an export directory (weights + one compiled graph per bucket)."""
    from nxdc.cache.store import CompileCache
    from nxdc.export import prepare, run_export
    from nxdc.plan import ExportOptions, kv_cache_bytes, load_preset, weight_bytes
    from nxdc.progress import NullReporter, RichReporter

    preset = load_preset(config) if config else {}
    model = model or preset.pop("model", None)
    preset.pop("model", None)
    if not model:
        raise UserInputError("missing MODEL (a directory, .gguf file, Hub id or smollm2-135m)")
    flags = {
        "tp": tp,
        "batch_size": batch_size,
        "sequence_length": sequence_length,
        "max_context_length": max_context_length,
        "min_context_bucket": min_context_bucket,
        "context_buckets": _int_list(context_buckets, "--context-buckets") if context_buckets else None,
        "min_decode_bucket": min_decode_bucket,
        "decode_buckets": _int_list(decode_buckets, "--decode-buckets") if decode_buckets else None,
        "dtype": dtype,
        "backend": backend,
        "device": device,
    }
    opts = ExportOptions(**{**preset, **{k: v for k, v in flags.items() if v is not None}})
    if dry_run:
        _, _, spec, plan = prepare(model, opts, cache_dir)
        summary = {
            "model": model,
            "arch": spec.arch,
            "params": spec.param_count(),
            "plan": plan.to_dict(),
            "weight_bytes": weight_bytes(spec, plan.dtype),
            "kv_cache_bytes": kv_cache_bytes(spec, plan),
        }
        if json_out:
            print_json(summary)
        elif not quiet:
            err_console.print(
                f"{spec.arch}: {spec.param_count() / 1e6:.1f}M params, tp {plan.tp}, batch {plan.batch_size}, "
                f"seq {plan.sequence_length}, {plan.dtype}, {plan.backend}/{plan.device}\n"
                f"buckets: {', '.join(b.name for b in plan.buckets)}\n"
                f"weights {summary['weight_bytes'] / 2**20:.0f} MiB, KV cache {summary['kv_cache_bytes'] / 2**20:.0f} MiB"
            )
        return
    reporter = NullReporter() if (quiet or json_out) else RichReporter(err_console)
    result = run_export(model, output, opts, cache=CompileCache(cache_dir), reporter=reporter)
    if json_out:
        print_json(result.to_dict())
    elif not quiet:
        d = result.to_dict()
        err_console.print(
            f"[bold green]exported[/] {output} in {d['seconds']:.1f}s "
            f"({d['cache_hits']} cache hits, {d['compiled']} compiled)"
        )


def _int_list(s: str, flag: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in s.split(",") if x.strip())
    except ValueError:
        raise UserInputError(f"{flag} must be comma-separated integers (got {s!r})") from None
