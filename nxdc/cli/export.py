"""`nxdc export MODEL -o OUT`."""

from __future__ import annotations

from pathlib import Path

import typer

from nxdc.cli import export_options as O
from nxdc.cli.common import cli_errors, err_console, print_json
from nxdc.errors import UserInputError


@cli_errors
def export(
    model: str = typer.Argument(None, help="Local HF dir, .gguf file, Hub id (org/name), or 'smollm2-135m'."),
    output: Path = typer.Option(
        None, "-o", "--output", help="Export directory to write (not needed with --dry-run)."
    ),
    config: Path = typer.Option(None, "--config", help="TOML preset (configs/*.toml); flags override it."),
    tp: int = O.TP,
    batch_size: int = O.BATCH_SIZE,
    sequence_length: int = O.SEQUENCE_LENGTH,
    max_context_length: int = O.MAX_CONTEXT_LENGTH,
    min_context_bucket: int = O.MIN_CONTEXT_BUCKET,
    context_buckets: str = O.CONTEXT_BUCKETS,
    min_decode_bucket: int = O.MIN_DECODE_BUCKET,
    decode_buckets: str = O.DECODE_BUCKETS,
    dtype: str = O.DTYPE,
    weights: str = O.WEIGHTS,
    kv_cache: str = O.KV_CACHE,
    check_accuracy: bool = typer.Option(
        False,
        "--check-accuracy",
        help="Measure the --weights / --kv-cache formats' error against fp32 on a fixed text.",
    ),
    speculation_length: int = O.SPECULATION_LENGTH,
    num_layers: int = O.NUM_LAYERS,
    chunk_buckets: str = O.CHUNK_BUCKETS,
    decode_batch_sizes: str = O.DECODE_BATCH_SIZES,
    backend: str = O.BACKEND,
    kv_update: str = O.KV_UPDATE,
    device: str = O.DEVICE,
    cache_dir: Path = typer.Option(
        None, "--cache-dir", envvar="NXDC_CACHE_DIR", help="Compile cache directory."
    ),
    remote: str = typer.Option(
        None,
        "--remote",
        help="Cache remote to pull missing graphs from (docs/cache.md). \\[default: NXDC_CACHE_REMOTE, then `nxdc cache set-remote`]",
    ),
    require_cache: bool = typer.Option(
        False,
        "--require-cache",
        help="Fail instead of compiling locally when the cache remote is unreachable.",
    ),
    dry_run: bool = typer.Option(False, "--dry-run", help="Validate and print the plan; read no weights."),
    config_only: Path = typer.Option(
        None,
        "--config-only",
        help="Plan from this config.json alone (implies --dry-run): size a deployment with no weights, "
        "no download and no check that the backend/device exist here. MODEL may also be a config.json.",
    ),
    json_out: bool = typer.Option(False, "--json", help="Print a JSON summary on stdout."),
    quiet: bool = typer.Option(False, "-q", "--quiet", help="No progress output."),
    verbose: bool = typer.Option(False, "-v", "--verbose", help="Tracebacks on errors."),
) -> None:
    """Compile MODEL into an export directory (weights + one compiled graph per bucket)."""
    flags = dict(locals())  # the arguments; export_options keeps the ExportOptions ones
    from rich.markup import escape

    from nxdc.export import plan_summary, prepare, run_export
    from nxdc.plan import load_preset
    from nxdc.progress import NullReporter, RichReporter
    from nxdc.sync.remote_cache import open_cache

    preset = load_preset(config) if config else {}
    model = model or preset.pop("model", None)
    preset.pop("model", None)
    if config_only is None and model and model.endswith(".json") and Path(model).is_file():
        config_only = Path(model)  # a config.json alone: plan only
    if config_only is not None:
        model = model or str(config_only)
    if not model:
        raise UserInputError("missing MODEL (a directory, .gguf file, Hub id or smollm2-135m)")
    if output is None and not (dry_run or config_only is not None):
        raise UserInputError("missing -o/--output (the export directory to write)")
    opts = O.export_options(preset, flags)
    if dry_run or config_only is not None:
        if config_only is not None:
            from nxdc.plan import plan_from_config

            _, spec, plan = plan_from_config(config_only, opts)
        else:
            _, _, spec, plan = prepare(model, opts, cache_dir)
        summary = plan_summary(model, spec, plan)
        summary["config_only"] = config_only is not None
        if json_out:
            print_json(summary)
        elif not quiet:
            err_console.print(describe_plan(summary), soft_wrap=True, markup=False)
        return
    reporter = NullReporter() if (quiet or json_out) else RichReporter(err_console)
    cache = open_cache(
        cache_dir,
        remote,
        require_cache,
        warn=lambda m: err_console.print(f"[yellow]warning:[/] {escape(m)}", soft_wrap=True),
    )
    if check_accuracy and opts.weights in (None, opts.dtype) and opts.kv_cache in (None, opts.dtype):
        raise UserInputError(
            "--check-accuracy measures --weights / --kv-cache formats against fp32: pass one of them"
        )
    if check_accuracy and opts.dtype != "fp32":
        raise UserInputError(
            f"--check-accuracy compares against fp32 and needs --dtype fp32 (got {opts.dtype})"
        )
    result = run_export(model, output, opts, cache=cache, reporter=reporter)
    summary = result.to_dict()
    if check_accuracy:
        from nxdc.accuracy import measure

        summary["accuracy"] = acc = measure(model, opts, cache_root=cache_dir)
    if json_out:
        print_json(summary)
    elif not quiet:
        err_console.print(
            f"[bold green]exported[/] {output} in {summary['seconds']:.1f}s "
            f"({summary['cache_hits']} cache hits, {summary['compiled']} compiled; "
            f"peak memory {summary['peak_rss_mib'] / 1024:.1f} GiB)"
        )
        if check_accuracy:
            err_console.print(
                f"accuracy of --weights {acc['weights']} --kv-cache {acc['kv_cache']} vs fp32 on {acc['tokens']} tokens: "
                f"top-1 agreement {acc['top1_agreement']:.1%}, perplexity {acc['perplexity']:.3f} vs "
                f"{acc['perplexity_fp32']:.3f} ({acc['perplexity_ratio'] - 1:+.2%}), "
                f"max |logit error| {acc['max_abs_logit_error']:.3g}"
            )


def describe_plan(s: dict) -> str:
    p, sh = s["plan"], s["sharding"]
    mib = lambda n: f"{n / 2**20:,.0f} MiB"  # noqa: E731
    lines = [
        f"{s['arch']}: {s['params'] / 1e6:,.1f}M params, tp {p['tp']}, batch {p['batch_size']}, "
        f"seq {p['sequence_length']}, {p['dtype']}, {p['backend']}/{p['device']}",
        "buckets: " + ", ".join(f"{b['kind']}-{b['length']}" for b in p["buckets"]),
        f"weights {mib(s['weight_bytes'])} ({p.get('weights') or p['dtype']}), "
        f"KV cache {mib(s['kv_cache_bytes'])} ({p.get('kv_cache') or p['dtype']})",
    ]
    moe = s.get("moe")
    if moe:
        lines.insert(
            1,
            f"MoE: {moe['experts']} experts, top {moe['experts_per_token']} per token "
            f"({moe['active_params'] / 1e6:,.1f}M params active per token)",
        )
    if s.get("config_only"):
        lines.append("planned from config.json alone: no weights read; backend/device not checked here")
    if p["tp"] > 1:
        mlp = (
            f"each expert {moe['expert_intermediate_per_rank']:,} per rank, router replicated"
            if moe
            else f"MLP {sh['intermediate_per_rank']:,} per rank"
        )
        lines += [
            f"sharding ({sh['strategy']}): {sh['heads']}",
            "  q/k/v, gate/up column-parallel; o, down row-parallel (one all-reduce each per layer); "
            f"lm_head vocab-parallel ({sh['vocab_per_rank']:,} rows per rank, all-gathered); "
            f"{mlp}; embedding and norms replicated "
            "(a lookup reads only the batch's rows)",
            f"per rank: weights {mib(sh['rank_weight_bytes'])}, KV cache {mib(sh['rank_kv_cache_bytes'])}",
        ]
    return "\n".join(lines)
