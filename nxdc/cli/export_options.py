"""The export options, declared once: `nxdc export` and `nxdc cache pull MODEL` take the same
flags and build the same ``ExportOptions`` from them (and from a ``--config`` preset)."""

from __future__ import annotations

from pathlib import Path

import typer

from nxdc.errors import UserInputError
from nxdc.plan import LIST_OPTIONS, ExportOptions, load_preset

TP = typer.Option(None, "--tp", help="Tensor-parallel degree. \\[default: 1]")
BATCH_SIZE = typer.Option(None, "--batch-size", help="Static batch size. \\[default: 1]")
SEQUENCE_LENGTH = typer.Option(
    None, "--sequence-length", help="KV-cache length (prompt + new tokens). \\[default: min(1024, model max)]"
)
MAX_CONTEXT_LENGTH = typer.Option(
    None, "--max-context-length", help="Largest prompt bucket. \\[default: sequence length]"
)
MIN_CONTEXT_BUCKET = typer.Option(
    None, "--min-context-bucket", help="Smallest prompt bucket. \\[default: 128]"
)
CONTEXT_BUCKETS = typer.Option(None, "--context-buckets", help="Explicit prompt buckets, e.g. 128,512.")
MIN_DECODE_BUCKET = typer.Option(
    None, "--min-decode-bucket", help="Smallest decode cache length. \\[default: 256]"
)
DECODE_BUCKETS = typer.Option(None, "--decode-buckets", help="Explicit decode cache lengths, e.g. 512,1024.")
DTYPE = typer.Option(None, "--dtype", help="fp32 | bf16. \\[default: fp32]")
WEIGHTS = typer.Option(
    None,
    "--weights",
    help="Weight storage: fp32 | fp16 | bf16 | int8 | int8-row | int4 | int4-sym | auto. int8 / int4 scale "
    "groups of 32 inputs (-gG for G, e.g. int4-g64); auto keeps a GGUF file's own quantized tensors "
    "(activations stay --dtype fp32; docs/weights.md). \\[default: auto for GGUF at --dtype fp32 on CPU, "
    "else --dtype]",
)
KV_CACHE = typer.Option(
    None,
    "--kv-cache",
    help="KV-cache storage: fp32 | fp16 | bf16 (attention still computes in --dtype). \\[default: the --weights format for fp16 / bf16 weights, else --dtype]",
)
SPECULATION_LENGTH = typer.Option(
    None,
    "--speculation-length",
    help="Add verify graphs scoring K draft tokens per call (speculative decoding). \\[default: 0]",
)
NUM_LAYERS = typer.Option(
    None, "--num-layers", help="Keep only the first L layers (a self-draft for speculation)."
)
CHUNK_BUCKETS = typer.Option(
    None,
    "--chunk-buckets",
    help="Single-row prefill chunks for `nxdc serve`, e.g. 32,128,512 (docs/serve.md).",
)
DECODE_BATCH_SIZES = typer.Option(
    None,
    "--decode-batch-sizes",
    help="Also decode graphs stepping only this many batch rows, e.g. 1 (cheaper steps when few are busy).",
)
BACKEND = typer.Option(
    None, "--backend", help="inductor | xla | neuron (docs/backends.md). \\[default: inductor]"
)
KV_UPDATE = typer.Option(
    None,
    "--kv-update",
    help="How graphs write the KV cache: in-place | functional (xla and neuron: functional only). \\[default: the backend's]",
)
DEVICE = typer.Option(
    None,
    "--device",
    help="cpu | cuda[:N] (inductor); cpu (xla); trn1 | trn2 | inf2 (neuron). \\[default: cpu]",
)


def export_options(preset: dict, flags: dict):
    """The preset's options overridden by the flags given (``flags``: a command's arguments,
    named as ExportOptions fields; None: not given); bucket lists parsed from their
    comma-separated form. Shared by ``export`` and ``cache pull``."""
    given = {k: v for k, v in flags.items() if v is not None and k in ExportOptions.fields()}
    for name in LIST_OPTIONS:
        if isinstance(given.get(name), str):
            given[name] = _int_list(given[name], f"--{name.replace('_', '-')}")
    return ExportOptions(**{**preset, **given})


def _int_list(s: str, flag: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in s.split(",") if x.strip())
    except ValueError:
        raise UserInputError(f"{flag} must be comma-separated integers (got {s!r})") from None


def from_preset(config: Path | None, flags: dict) -> ExportOptions:
    """``--config``'s preset (its ``model`` key aside) overridden by the flags given."""
    preset = load_preset(config) if config else {}
    preset.pop("model", None)
    return export_options(preset, flags)
