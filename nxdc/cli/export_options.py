"""The export options' flags: `nxdc export` and `nxdc cache pull MODEL` take one flag per
``ExportOptions`` field, built here from the field (its name: ``--batch-size`` for
``batch_size``; its type; its default, shown as ``[default: ...]``) and its row in ``FLAGS``
(the help). ``@export_flags`` adds them to a command's signature, which Typer reads; the
command receives them in ``**options`` (None: not given) and hands them to ``nxdc.export``."""

from __future__ import annotations

import typing
from dataclasses import dataclass

import typer

from nxdc.api.export import with_export_options
from nxdc.compile.backends.registry import help_text
from nxdc.plan import (
    DECODE_MATMULS,
    DEFAULT_SEQUENCE_LENGTH,
    DTYPES,
    KV_FORMATS,
    LIST_OPTIONS,
    PREFILL_MATMULS,
)

BACKEND_HELP = help_text()


@dataclass(frozen=True)
class Flag:
    help: str
    default: str | None = None  # the "[default: ...]" text where the field's default is None


FLAGS = {
    "tp": Flag("Tensor-parallel degree."),
    "batch_size": Flag("Static batch size."),
    "sequence_length": Flag(
        "KV-cache length (prompt + new tokens).", f"min({DEFAULT_SEQUENCE_LENGTH}, model max)"
    ),
    "max_context_length": Flag("Largest prompt bucket.", "sequence length"),
    "min_context_bucket": Flag("Smallest prompt bucket."),
    "context_buckets": Flag("Explicit prompt buckets, e.g. 128,512."),
    "min_decode_bucket": Flag("Smallest decode cache length."),
    "decode_buckets": Flag("Explicit decode cache lengths, e.g. 512,1024."),
    "dtype": Flag(f"{' | '.join(DTYPES)}."),
    "weights": Flag(
        "Weight storage: fp32 | fp16 | bf16 | int8 | int8-row | int4 | int4-sym | auto. int8 / int4 scale "
        "groups of 32 inputs (-gG for G, e.g. int4-g64); int4's scales are fp16, int8's fp32 (-f16 / -f32 "
        "to choose; int4-k: two-level, as Q4_K); auto keeps a GGUF file's own quantized tensors "
        "(activations stay --dtype fp32; docs/weights.md).",
        "auto for GGUF at --dtype fp32 on CPU, else --dtype",
    ),
    "kv_cache": Flag(
        f"KV-cache storage: {' | '.join(KV_FORMATS)} (attention still computes in --dtype).",
        "the --weights format for fp16 / bf16 weights, else --dtype",
    ),
    "speculation_length": Flag("Add verify graphs scoring K draft tokens per call (speculative decoding)."),
    "num_layers": Flag("Keep only the first L layers (a self-draft for speculation)."),
    "chunk_buckets": Flag("Single-row prefill chunks for `nxdc serve`, e.g. 32,128,512 (docs/serve.md)."),
    "decode_batch_sizes": Flag(
        "Also decode graphs stepping only this many batch rows, e.g. 1 (cheaper steps when few are busy)."
    ),
    # from the backends' own rules (compile/backends/registry.py)
    "backend": Flag(BACKEND_HELP["backend"]),
    "kv_update": Flag(BACKEND_HELP["kv_update"], "the backend's first"),
    "device": Flag(BACKEND_HELP["device"]),
    "prefill_matmul": Flag(
        f"{' | '.join(PREFILL_MATMULS)}: how prompt graphs multiply on CPUs with AMX. tiles: int4 and "
        "--dtype bf16 weights on bf16 tiles, activations rounded to bf16 (prompts 3-6x faster); exact: "
        "fp32 products as decode has them; tiles-int8: --weights int8 on the tiles too (activations in "
        "two bf16 parts; greedy text may part from exact int8's: docs/weights.md).",
        PREFILL_MATMULS[0],
    ),
    "decode_matmul": Flag(
        f"{' | '.join(DECODE_MATMULS)}: how decode and verify graphs multiply integer weights (int4, "
        "int8, a GGUF's kept quants) on CPUs with AVX-512 VNNI. exact: fp32 products; int8: activations "
        "quantized to int8, 32 per scale, integer dot products as llama.cpp does (decode up to 2x "
        "faster at size; text may differ from transformers' after a near-tie: docs/weights.md).",
        DECODE_MATMULS[0],
    ),
}


def _typer_option(name: str, kind, default) -> tuple[type, typer.models.OptionInfo]:
    """The flag of the ExportOptions field ``name`` (of type ``kind``, default ``default``)."""
    if name not in FLAGS:
        raise KeyError(f"ExportOptions.{name} has no flag: give it a row in nxdc/cli/export_options.py FLAGS")
    flag = FLAGS[name]
    shown = flag.default if flag.default is not None else default
    text = flag.help if shown is None else f"{flag.help} \\[default: {shown}]"
    return _cli_type(name, kind), typer.Option(None, f"--{name.replace('_', '-')}", help=text)


def _cli_type(name: str, kind) -> type:
    """A bucket list is typed comma-separated (str); an ``int | None`` field takes an int."""
    if name in LIST_OPTIONS:
        return str
    return next(a for a in (*typing.get_args(kind), kind) if a is not type(None))


export_flags = with_export_options(_typer_option, after="config")
