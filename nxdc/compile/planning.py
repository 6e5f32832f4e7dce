"""ModelSpec + ExportOptions -> ExportPlan: everything an export will do. Every "can't shard",
"won't fit" and "bad option" error is raised here, before any weight is read; a backend's own
rules (its KV-update modes, its checks) come from its ``RULES`` through the registry."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

from nxdc.archs import spec_from_config
from nxdc.buckets import Bucket, context_buckets
from nxdc.compile.backends.registry import check_options
from nxdc.errors import UnsupportedError, UserInputError
from nxdc.model import weight_format
from nxdc.model.sharding import check_tp, shard_layout
from nxdc.plan import (
    DECODE_MATMULS,
    DEFAULT_SEQUENCE_LENGTH,
    DTYPES,
    PREFILL_MATMULS,
    ExportOptions,
    ExportPlan,
    planned_spec,
    stored_kv_cache,
)
from nxdc.spec import ModelSpec


def _positive(name: str, value: int) -> None:
    if not isinstance(value, int) or value < 1:
        raise UserInputError(f"--{name.replace('_', '-')} must be a positive integer (got {value!r})")


def _choice(opts: ExportOptions, name: str, choices: tuple[str, ...]) -> str:
    """The option ``name``'s value, one of ``choices`` (default: the first)."""
    value = getattr(opts, name) or choices[0]
    if value not in choices:
        raise UserInputError(
            f"--{name.replace('_', '-')} must be one of {', '.join(choices)} (got {value!r})"
        )
    return value


def make_plan(spec: ModelSpec, opts: ExportOptions) -> ExportPlan:
    """Check the options against the model and fill in the defaults. Whether this machine has
    the backend and device is the exporter's check (a plan may be for another machine:
    ``--config-only``)."""
    if opts.sequence_length is None:
        limits = [DEFAULT_SEQUENCE_LENGTH, spec.max_position_embeddings, spec.sliding_window]
        opts = dataclasses.replace(opts, sequence_length=min(n for n in limits if n is not None))
    for name in ("tp", "batch_size", "sequence_length", "min_context_bucket", "min_decode_bucket"):
        _positive(name, getattr(opts, name))
    if opts.dtype not in DTYPES:
        raise UserInputError(f"--dtype must be one of {', '.join(DTYPES)} (got {opts.dtype!r})")
    kv_update = check_options(opts)  # the backend's rules (compile/backends/registry.py)
    _check_fits(spec, opts)
    ctx, dec = _context_and_decode_lengths(opts)
    buckets = [Bucket("context", n) for n in ctx] + [Bucket("decode", n) for n in dec]
    if opts.num_layers is not None:
        _positive("num_layers", opts.num_layers)
        if opts.num_layers >= spec.num_layers:
            raise UserInputError(
                f"--num-layers {opts.num_layers} must be below the model's {spec.num_layers} layers"
            )
    k = opts.speculation_length
    if not isinstance(k, int) or k < 0:
        raise UserInputError(f"--speculation-length must be a non-negative integer (got {k!r})")
    if k and k + 1 > min(dec):
        raise UserInputError(f"--speculation-length {k} needs decode buckets of more than {k + 1} slots")
    if k:  # one verify graph per decode cache length: K+1 tokens scored against the cache
        buckets += [Bucket("verify", n) for n in dec]
    buckets += _serving_buckets(opts, dec)
    weights = _weight_format(opts, spec)
    return ExportPlan(
        tp=opts.tp,
        batch_size=opts.batch_size,
        sequence_length=opts.sequence_length,
        dtype=opts.dtype,
        backend=opts.backend,
        device=opts.device,
        buckets=tuple(buckets),
        speculation_length=k,
        weights=weights,
        kv_cache=stored_kv_cache(opts.kv_cache, weights, opts.dtype),
        source_num_layers=spec.num_layers if opts.num_layers else None,
        kv_update=kv_update,
        prefill_matmul=_choice(opts, "prefill_matmul", PREFILL_MATMULS),
        decode_matmul=_choice(opts, "decode_matmul", DECODE_MATMULS),
    )


def _check_fits(spec: ModelSpec, opts: ExportOptions) -> None:
    """The model can be sharded ``--tp`` ways and attends over ``--sequence-length`` positions."""
    why = check_tp(spec, opts.tp)
    if why:
        raise UnsupportedError(why)
    if opts.sequence_length > spec.max_position_embeddings:
        raise UserInputError(
            f"--sequence-length {opts.sequence_length} exceeds the model's "
            f"max_position_embeddings ({spec.max_position_embeddings})"
        )
    if spec.sliding_window is not None and opts.sequence_length > spec.sliding_window:
        raise UserInputError(
            f"--sequence-length {opts.sequence_length} exceeds the model's sliding_window "
            f"({spec.sliding_window}): nxdc attends over the whole cache, which matches the model "
            f"only within its window; use --sequence-length {spec.sliding_window} or less"
        )
    if spec.num_heads % spec.num_kv_heads:
        raise UserInputError(
            f"num_attention_heads ({spec.num_heads}) is not a multiple of "
            f"num_key_value_heads ({spec.num_kv_heads})"
        )


def _context_and_decode_lengths(opts: ExportOptions) -> tuple[list[int], list[int]]:
    """The prefill bucket lengths and the decode cache lengths (the last: the sequence length)."""
    max_ctx = opts.max_context_length or opts.sequence_length
    _positive("max_context_length", max_ctx)
    if max_ctx > opts.sequence_length:
        raise UserInputError(
            f"--max-context-length {max_ctx} exceeds --sequence-length {opts.sequence_length}"
        )
    ctx = context_buckets(max_ctx, opts.min_context_bucket, opts.context_buckets)
    if max(ctx) > opts.sequence_length:
        raise UserInputError(f"context bucket {max(ctx)} exceeds --sequence-length {opts.sequence_length}")
    dec = context_buckets(opts.sequence_length, opts.min_decode_bucket, opts.decode_buckets, kind="decode")
    if dec[-1] != opts.sequence_length:
        raise UserInputError(
            f"the largest decode bucket must equal --sequence-length {opts.sequence_length} (got {dec[-1]})"
        )
    return ctx, dec


def _serving_buckets(opts: ExportOptions, dec: list[int]) -> list[Bucket]:
    """``--chunk-buckets``: single-row prefill graphs; ``--decode-batch-sizes``: decode graphs over
    fewer rows than the batch, one per decode cache length."""
    out = []
    if opts.chunk_buckets:
        chunks = context_buckets(opts.sequence_length, 1, opts.chunk_buckets, kind="chunk")
        out += [Bucket("chunk", n) for n in chunks]
    if opts.decode_batch_sizes:
        sizes = sorted(set(opts.decode_batch_sizes))
        bad = [b for b in sizes if not isinstance(b, int) or not 1 <= b < opts.batch_size]
        if bad:
            raise UserInputError(
                f"--decode-batch-sizes must lie in 1..{opts.batch_size - 1} (below --batch-size "
                f"{opts.batch_size}); got {bad[0]!r}"
            )
        out += [Bucket("decode", n, b) for b in sizes for n in dec]
    return out


def _weight_format(opts: ExportOptions, spec: ModelSpec) -> str | None:
    """The plan's weight format (canonical name, ``model/weight_format.py``), None for ``--dtype``."""
    if opts.weights is None or opts.weights == opts.dtype:
        return None
    if opts.weights == weight_format.AUTO:  # resolved against the source (export.prepare)
        if opts.dtype != "fp32":
            raise UserInputError(f"--weights auto needs --dtype fp32 (got --dtype {opts.dtype})")
        return weight_format.AUTO
    try:
        fmt = weight_format.from_user(opts.weights)
    except ValueError as e:
        raise UserInputError(str(e)) from None
    if opts.dtype != "fp32":
        raise UserInputError(
            f"--weights {opts.weights} needs --dtype fp32 (reduced-precision weights with fp32 activations); "
            f"--dtype {opts.dtype} stores the weights in {opts.dtype}"
        )
    layout = shard_layout(spec, opts.tp)
    inputs = {"the hidden size": spec.hidden_size, "o_proj (per rank)": layout.heads * spec.head_dim}
    if not spec.is_moe:
        inputs["down_proj (per rank)"] = layout.intermediate
    for what, k in inputs.items():
        why = fmt.check_inputs(k, what)
        if why:
            raise UserInputError(
                f"--weights {opts.weights} at --tp {opts.tp}: {why}; pick a group size that divides it"
            )
    return fmt.name


def read_config_json(path: str | os.PathLike) -> dict[str, Any]:
    """A Hugging Face config.json (or a directory holding one), for planning without weights."""
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    if not p.is_file():
        raise UserInputError(f"config file {path} does not exist")
    try:
        cfg = json.loads(p.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserInputError(f"{p} is not valid JSON: {e}") from e
    if not isinstance(cfg, dict):
        raise UserInputError(f"{p} is not a Hugging Face config (a JSON object)")
    return cfg


def plan_from_config(path: str | os.PathLike, opts: ExportOptions) -> tuple[dict, ModelSpec, ExportPlan]:
    """Spec and plan from a config.json alone (``nxdc export --config-only``): sizes a
    deployment for another machine, so the backend and device are not checked here."""
    cfg = read_config_json(path)
    spec = spec_from_config(cfg)
    plan = make_plan(spec, opts)
    if plan.weights == weight_format.AUTO:  # no GGUF file here: the compute dtype
        plan = dataclasses.replace(plan, weights=None)
    return cfg, planned_spec(spec, opts), plan
