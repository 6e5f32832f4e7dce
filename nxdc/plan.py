"""ExportPlan: ModelSpec + options -> everything an export will do. Every "can't shard",
"won't fit" and "bad option" error is raised here, before any weight is read."""

from __future__ import annotations

import dataclasses
import os
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nxdc.compile.buckets import Bucket, context_buckets
from nxdc.errors import UnsupportedError, UserInputError
from nxdc.spec import ModelSpec

DTYPES = ("fp32", "bf16")
DTYPE_BYTES = {"fp32": 4, "bf16": 2}
BACKENDS = ("inductor", "neuron")


@dataclass(frozen=True)
class ExportOptions:
    """What the user asked for (CLI flags and/or a TOML preset)."""

    tp: int = 1
    batch_size: int = 1
    sequence_length: int | None = None  # default: min(1024, max_position_embeddings)
    max_context_length: int | None = None  # largest prefill bucket; default sequence_length
    min_context_bucket: int = 128
    context_buckets: tuple[int, ...] | None = None  # explicit list overrides powers of two
    min_decode_bucket: int = 256  # decode graphs attend to 256, 512, ... cache slots (up to S)
    decode_buckets: tuple[int, ...] | None = None
    dtype: str = "fp32"
    backend: str = "inductor"
    device: str = "cpu"

    @classmethod
    def fields(cls) -> set[str]:
        return {f.name for f in dataclasses.fields(cls)}


@dataclass(frozen=True)
class ExportPlan:
    tp: int
    batch_size: int
    sequence_length: int
    dtype: str
    backend: str
    device: str
    buckets: tuple[Bucket, ...]

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ExportPlan:
        d = dict(d)
        d["buckets"] = tuple(Bucket(**b) for b in d["buckets"])
        return cls(**d)

    @property
    def context(self) -> list[Bucket]:
        return [b for b in self.buckets if b.kind == "context"]

    @property
    def decode(self) -> list[Bucket]:
        return [b for b in self.buckets if b.kind == "decode"]


def load_preset(path: str | os.PathLike) -> dict[str, Any]:
    """A TOML export preset: keys are ExportOptions fields (dashes or underscores)."""
    p = Path(path)
    if not p.is_file():
        raise UserInputError(f"config file {path} does not exist")
    try:
        raw = tomllib.loads(p.read_text())
    except tomllib.TOMLDecodeError as e:
        raise UserInputError(f"config file {path} is not valid TOML: {e}") from e
    data = raw.get("export", raw)
    out = {k.replace("-", "_"): v for k, v in data.items() if k != "model"}
    unknown = set(out) - ExportOptions.fields()
    if unknown:
        raise UserInputError(
            f"config file {path}: unknown keys {', '.join(sorted(unknown))} "
            f"(known: {', '.join(sorted(ExportOptions.fields()))})"
        )
    for key in ("context_buckets", "decode_buckets"):
        if key in out:
            out[key] = tuple(out[key])
    if "model" in data:
        out["model"] = data["model"]
    return out


def _positive(name: str, value: int) -> None:
    if not isinstance(value, int) or value < 1:
        raise UserInputError(f"--{name.replace('_', '-')} must be a positive integer (got {value!r})")


DEFAULT_SEQUENCE_LENGTH = 1024


def make_plan(spec: ModelSpec, opts: ExportOptions) -> ExportPlan:
    if opts.sequence_length is None:
        opts = dataclasses.replace(
            opts, sequence_length=min(DEFAULT_SEQUENCE_LENGTH, spec.max_position_embeddings)
        )
    for name in ("tp", "batch_size", "sequence_length", "min_context_bucket", "min_decode_bucket"):
        _positive(name, getattr(opts, name))
    if opts.dtype not in DTYPES:
        raise UserInputError(f"--dtype must be one of {', '.join(DTYPES)} (got {opts.dtype!r})")
    if opts.backend not in BACKENDS:
        raise UserInputError(f"--backend must be one of {', '.join(BACKENDS)} (got {opts.backend!r})")
    from nxdc.compile.backends import get_backend

    get_backend(opts.backend, opts.device)  # refuses unavailable backends/devices now
    from nxdc.model.parallel import check_tp

    why = check_tp(spec, opts.tp)
    if why:
        raise UnsupportedError(why)
    if opts.sequence_length > spec.max_position_embeddings:
        raise UserInputError(
            f"--sequence-length {opts.sequence_length} exceeds the model's "
            f"max_position_embeddings ({spec.max_position_embeddings})"
        )
    if spec.num_heads % spec.num_kv_heads:
        raise UserInputError(
            f"num_attention_heads ({spec.num_heads}) is not a multiple of "
            f"num_key_value_heads ({spec.num_kv_heads})"
        )
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
    buckets = [Bucket("context", n) for n in ctx] + [Bucket("decode", n) for n in dec]
    return ExportPlan(
        tp=opts.tp,
        batch_size=opts.batch_size,
        sequence_length=opts.sequence_length,
        dtype=opts.dtype,
        backend=opts.backend,
        device=opts.device,
        buckets=tuple(buckets),
    )


def weight_bytes(spec: ModelSpec, dtype: str) -> int:
    return spec.param_count() * DTYPE_BYTES[dtype]


def rank_weight_bytes(spec: ModelSpec, plan: ExportPlan) -> int:
    """Bytes of one rank's weight file: its shards (padding included) plus the replicated
    embedding and norms (a tied lm_head shard is sliced from the embedding at load time)."""
    from nxdc.compile.trace import meta_decoder

    model = meta_decoder(spec, plan)
    seen, n = set(), 0
    for name, t in model.state_dict(keep_vars=True).items():
        if name.endswith(("_cache", "rope_cos", "rope_sin")) or id(t) in seen:
            continue
        seen.add(id(t))
        n += t.numel()
    return n * DTYPE_BYTES[plan.dtype]


def kv_cache_bytes(
    spec: ModelSpec, plan: ExportPlan, slots: int | None = None, per_rank: bool = False
) -> int:
    """K and V bytes for ``slots`` cache positions per sequence (default: the whole cache),
    summed over ranks (replicated and padded KV heads included) unless ``per_rank``."""
    from nxdc.model.parallel import shard_layout

    slots = plan.sequence_length if slots is None else slots
    kv = shard_layout(spec, plan.tp).kv * (1 if per_rank else plan.tp)
    per_slot = 2 * spec.num_layers * kv * spec.head_dim * DTYPE_BYTES[plan.dtype]
    return plan.batch_size * slots * per_slot
