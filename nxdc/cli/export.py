"""`nxdc export MODEL -o OUT`: parses the flags, calls ``nxdc.export`` (or, for a plan only,
``plan_export``) and prints the result."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.markup import escape

from nxdc.api.export import export as export_model
from nxdc.api.export import plan_export
from nxdc.cli.common import CACHE_DIR, JSON, QUIET, VERBOSE, cli_errors, err_console, log_warnings, print_json
from nxdc.cli.export_options import export_flags
from nxdc.progress import RichReporter


@cli_errors
@export_flags
def export(
    model: str = typer.Argument(None, help="Local HF dir, .gguf file, Hub id (org/name), or 'smollm2-135m'."),
    output: Path = typer.Option(
        None, "-o", "--output", help="Export directory to write (not needed with --dry-run)."
    ),
    config: Path = typer.Option(None, "--config", help="TOML preset (configs/*.toml); flags override it."),
    check_accuracy: bool = typer.Option(
        False,
        "--check-accuracy",
        help="Measure the --weights / --kv-cache formats' error against fp32 on a fixed text.",
    ),
    cache_dir: Path = CACHE_DIR,
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
    json_out: bool = JSON,
    quiet: bool = QUIET,
    verbose: bool = VERBOSE,
    **options,  # the export options (nxdc/cli/export_options.py); None: not given
) -> None:
    """Compile MODEL into an export directory (weights + one compiled graph per bucket)."""
    if dry_run or config_only is not None or (model and model.endswith(".json") and Path(model).is_file()):
        summary = plan_export(model, config=config, config_only=config_only, cache_dir=cache_dir, **options)
        _show(summary, describe_plan(summary), json_out, quiet, markup=False)
        return
    with log_warnings():
        result = export_model(
            model,
            output,
            config=config,
            cache_dir=cache_dir,
            remote=remote,
            require_cache=require_cache,
            check_accuracy=check_accuracy,
            progress=None if (quiet or json_out) else RichReporter(err_console),
            **options,
        )
    _show(result.to_dict(), describe_result(result), json_out, quiet)


def _show(summary: dict, text: str, json_out: bool, quiet: bool, markup: bool = True) -> None:
    if json_out:
        print_json(summary)
    elif not quiet:
        err_console.print(text, soft_wrap=True, markup=markup)


def describe_result(r) -> str:
    """The lines a finished export prints (an ``nxdc.ExportResult``)."""
    line = (
        f"[bold green]exported[/] {escape(str(r.out))} in {r.seconds:.1f}s ({r.cache_hits} cache hits, "
        f"{r.compiled} compiled; peak memory {r.peak_rss_mib / 1024:.1f} GiB)"
    )
    acc = r.accuracy
    if acc is None:
        return line
    text = (
        f"{line}\naccuracy of --weights {acc['weights']} --kv-cache {acc['kv_cache']} vs fp32 on {acc['tokens']} tokens: "
        + _agreement(acc)
    )
    if "decode" in acc:
        text += f"\n  with decode's int8 activations (--decode-matmul int8): {_agreement(acc['decode'])}"
    return text


def _agreement(a: dict) -> str:
    return (
        f"top-1 agreement {a['top1_agreement']:.1%}, perplexity {a['perplexity']:.3f} vs "
        f"{a['perplexity_fp32']:.3f} ({a['perplexity_ratio'] - 1:+.2%}), "
        f"max |logit error| {a['max_abs_logit_error']:.3g}"
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
