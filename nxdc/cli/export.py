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
    remote: str = typer.Option(
        None,
        "--remote",
        help="Cache remote to pull missing graphs from (docs/cache.md). [default: NXDC_CACHE_REMOTE, then `nxdc cache set-remote`]",
    ),
    require_cache: bool = typer.Option(
        False,
        "--require-cache",
        help="Fail instead of compiling locally when the cache remote is unreachable.",
    ),
    dry_run: bool = typer.Option(False, "--dry-run", help="Validate and print the plan; read no weights."),
    json_out: bool = typer.Option(False, "--json", help="Print a JSON summary on stdout."),
    quiet: bool = typer.Option(False, "-q", "--quiet", help="No progress output."),
    verbose: bool = typer.Option(False, "-v", "--verbose", help="Tracebacks on errors."),
) -> None:
    """Compile MODEL into an export directory (weights + one compiled graph per bucket)."""
    from rich.markup import escape

    from nxdc.cache.transfer import open_cache
    from nxdc.export import prepare, run_export
    from nxdc.plan import load_preset
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
        "context_buckets": context_buckets,
        "min_decode_bucket": min_decode_bucket,
        "decode_buckets": decode_buckets,
        "dtype": dtype,
        "backend": backend,
        "device": device,
    }
    opts = export_options(preset, flags)
    if dry_run:
        _, _, spec, plan = prepare(model, opts, cache_dir)
        summary = plan_summary(model, spec, plan)
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
    result = run_export(model, output, opts, cache=cache, reporter=reporter)
    if json_out:
        print_json(result.to_dict())
    elif not quiet:
        d = result.to_dict()
        err_console.print(
            f"[bold green]exported[/] {output} in {d['seconds']:.1f}s "
            f"({d['cache_hits']} cache hits, {d['compiled']} compiled)"
        )


def plan_summary(model: str, spec, plan) -> dict:
    """What ``--dry-run`` reports: the plan, its sharding and its memory, per rank and in all."""
    from nxdc.model.parallel import shard_layout
    from nxdc.plan import kv_cache_bytes, rank_weight_bytes, weight_bytes

    layout = shard_layout(spec, plan.tp)
    rank_w, rank_kv = rank_weight_bytes(spec, plan), kv_cache_bytes(spec, plan, per_rank=True)
    return {
        "model": model,
        "arch": spec.arch,
        "params": spec.param_count(),
        "plan": plan.to_dict(),
        "weight_bytes": weight_bytes(spec, plan.dtype),
        "kv_cache_bytes": kv_cache_bytes(spec, plan),
        "sharding": {
            "strategy": layout.strategy,
            "heads": layout.describe(spec),
            "q_heads_per_rank": layout.heads,
            "kv_heads_per_rank": layout.kv,
            "intermediate_per_rank": layout.intermediate,
            "vocab_per_rank": layout.vocab,
            "rank_weight_bytes": rank_w,
            "rank_kv_cache_bytes": rank_kv,
        },
    }


def describe_plan(s: dict) -> str:
    p, sh = s["plan"], s["sharding"]
    mib = lambda n: f"{n / 2**20:,.0f} MiB"  # noqa: E731
    lines = [
        f"{s['arch']}: {s['params'] / 1e6:,.1f}M params, tp {p['tp']}, batch {p['batch_size']}, "
        f"seq {p['sequence_length']}, {p['dtype']}, {p['backend']}/{p['device']}",
        "buckets: " + ", ".join(f"{b['kind']}-{b['length']}" for b in p["buckets"]),
        f"weights {mib(s['weight_bytes'])}, KV cache {mib(s['kv_cache_bytes'])}",
    ]
    if p["tp"] > 1:
        lines += [
            f"sharding ({sh['strategy']}): {sh['heads']}",
            "  q/k/v, gate/up column-parallel; o, down row-parallel (one all-reduce each per layer); "
            f"lm_head vocab-parallel ({sh['vocab_per_rank']:,} rows per rank, all-gathered); "
            f"MLP {sh['intermediate_per_rank']:,} per rank; embedding and norms replicated "
            "(a lookup reads only the batch's rows)",
            f"per rank: weights {mib(sh['rank_weight_bytes'])}, KV cache {mib(sh['rank_kv_cache_bytes'])}",
        ]
    return "\n".join(lines)


def export_options(preset: dict, flags: dict):
    """The preset's options overridden by the flags given (None: not given); bucket lists
    parsed from their comma-separated form. Shared by ``export`` and ``cache pull``."""
    from nxdc.plan import ExportOptions

    given = {k: v for k, v in flags.items() if v is not None}
    for name in ("context_buckets", "decode_buckets"):
        if isinstance(given.get(name), str):
            given[name] = _int_list(given[name], f"--{name.replace('_', '-')}")
    return ExportOptions(**{**preset, **given})


def _int_list(s: str, flag: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in s.split(",") if x.strip())
    except ValueError:
        raise UserInputError(f"{flag} must be comma-separated integers (got {s!r})") from None
