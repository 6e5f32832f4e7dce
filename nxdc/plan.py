"""What the user asks of an export (``ExportOptions``, a TOML preset) and what the export will do
(``ExportPlan``), with the sizes both imply. ``compile/planning.py`` turns one into the other,
checking the options against the model and the backend's rules."""

from __future__ import annotations

import dataclasses
import os
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nxdc.buckets import Bucket
from nxdc.errors import UserInputError
from nxdc.model.sharding import shard_layout
from nxdc.spec import ModelSpec

DTYPES = ("fp32", "bf16")
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
KV_FORMATS = ("fp32", "fp16", "bf16")
# How the prefill graphs multiply on CPUs with AMX (the first is the default): "tiles" puts int4,
# a GGUF's K-quants and --dtype bf16 on bf16 tiles (activations and weights rounded to bf16:
# model/layers.py Linear._tiled, kernels/prefill.cpp); "tiles-int8" int8 weights with one scale
# a group or row too (--weights int8, int8-row, a kept Q8_0; their activations go in as two bf16
# parts); "exact" keeps the decode kernels' exact fp32 products for every format.
PREFILL_MATMULS = ("tiles", "exact", "tiles-int8")
# How the decode and verify graphs multiply integer weights (int4, int8, a GGUF's kept quants) on
# CPUs with AVX-512 VNNI (the first is the default): with exact fp32 products, or on activations
# quantized to int8, 32 per scale, with integer dot products (model/layers.py Linear._integer,
# kernels/decode_q8.cpp: llama.cpp's numerics, decode up to 2x faster at size, greedy text no
# longer transformers' token for token).
DECODE_MATMULS = ("exact", "int8")
# ExportOptions that hold a list of integers (comma-separated on the command line)
LIST_OPTIONS = ("context_buckets", "decode_buckets", "chunk_buckets", "decode_batch_sizes")


@dataclass(frozen=True)
class ExportOptions:
    """What the user asked for: the export options of ``nxdc export`` and ``nxdc cache pull``
    (a flag per field, ``--batch-size`` for ``batch_size``, in this order; help in
    nxdc/cli/export_options.py), of a TOML preset and of ``nxdc.export``'s keywords."""

    tp: int = 1
    batch_size: int = 1
    sequence_length: int | None = None  # default: min(1024, max_position_embeddings)
    max_context_length: int | None = None  # largest prefill bucket; default sequence_length
    min_context_bucket: int = 128
    context_buckets: tuple[int, ...] | None = None  # explicit list overrides powers of two
    min_decode_bucket: int = 256  # decode graphs attend to 256, 512, ... cache slots (up to S)
    decode_buckets: tuple[int, ...] | None = None
    dtype: str = "fp32"
    weights: str | None = None  # storage of linear-layer weights (model/weight_format.py; default: dtype)
    kv_cache: str | None = None  # storage of the KV cache: fp32 | fp16 | bf16 (default: stored_kv_cache)
    speculation_length: int = 0  # K > 0: add verify graphs (K+1 tokens per call) for speculation
    num_layers: int | None = None  # keep only the first L layers (a self-draft for speculation)
    # `nxdc serve`: single-row prefill graphs of these chunk lengths (docs/serve.md)
    chunk_buckets: tuple[int, ...] | None = None
    # decode graphs that step only this many of the batch's rows (fewer busy rows: cheaper steps)
    decode_batch_sizes: tuple[int, ...] | None = None
    backend: str = "inductor"
    kv_update: str | None = None  # in-place | functional (default: the backend's first, its RULES)
    device: str = "cpu"
    prefill_matmul: str | None = None  # tiles | exact | tiles-int8 (default tiles): PREFILL_MATMULS
    decode_matmul: str | None = None  # exact | int8 (default exact): DECODE_MATMULS

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
    speculation_length: int = 0
    source_num_layers: int | None = None  # set when --num-layers truncated the model
    weights: str | None = None  # canonical format name (model/weight_format.py); None: ``dtype``
    kv_cache: str | None = None  # None: stored in ``dtype``
    kv_update: str = "in-place"  # in-place (index_copy_ on the caches) | functional (graphs return them)
    prefill_matmul: str = "exact"  # PREFILL_MATMULS; exports before it multiplied exactly
    decode_matmul: str = "exact"  # DECODE_MATMULS; the same
    weight_map: dict[str, str] | None = None  # weights "gguf": module -> format (model/weight_format.py)

    @property
    def weight_format(self) -> str:
        """How linear layers (and the embedding) store their weights; see docs/weights.md."""
        return self.weights or self.dtype

    @property
    def kv_format(self) -> str:
        """How the KV cache stores keys and values; see docs/weights.md."""
        return self.kv_cache or self.dtype

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ExportPlan:
        d = dict(d)
        d["buckets"] = tuple(Bucket(**b) for b in d["buckets"])
        d["kv_update"] = d.get("kv_update") or "in-place"  # exports before 0.1 wrote None for in-place
        return cls(**d)

    @property
    def context(self) -> list[Bucket]:
        return [b for b in self.buckets if b.kind == "context"]

    @property
    def decode(self) -> list[Bucket]:
        return [b for b in self.buckets if b.kind == "decode" and b.batch is None]

    @property
    def row_decode(self) -> list[Bucket]:
        """Decode graphs over ``batch`` of the batch's rows, named at run time."""
        return [b for b in self.buckets if b.kind == "decode" and b.batch is not None]

    @property
    def verify(self) -> list[Bucket]:
        return [b for b in self.buckets if b.kind == "verify"]

    @property
    def chunks(self) -> list[Bucket]:
        """Single-row prefill graphs (``nxdc serve``)."""
        return [b for b in self.buckets if b.kind == "chunk"]


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
    for key in LIST_OPTIONS:
        if key in out:
            out[key] = tuple(out[key])
    if "model" in data:
        out["model"] = data["model"]
    return out


DEFAULT_SEQUENCE_LENGTH = 1024


def _stored_format(value: str | None, dtype: str, choices: tuple[str, ...], flag: str) -> str | None:
    """A storage flag's value, None where it is the compute dtype (the default)."""
    if value is None or value == dtype:
        return None
    if value not in choices:
        raise UserInputError(f"{flag} must be one of {', '.join(choices)} (got {value!r})")
    return value


def stored_kv_cache(kv_cache: str | None, weights: str | None, dtype: str) -> str | None:
    """The plan's KV-cache storage (None: ``dtype``). By default, 16-bit weights
    (``--weights fp16 | bf16``) store the cache in their format too: half its bytes, 5-9% off a
    batch-8 step, within the accuracy budget (docs/weights.md). int8 weights keep it in
    ``dtype``: an fp16 cache took int8's top-1 agreement from 95.6% to 95.3%, too near the 95%
    budget to be a default. An explicit ``--kv-cache`` always wins."""
    if kv_cache is None and weights in ("fp16", "bf16"):
        return weights
    return _stored_format(kv_cache, dtype, KV_FORMATS, "--kv-cache")


def planned_spec(spec: ModelSpec, opts: ExportOptions) -> ModelSpec:
    """The model the export holds: ``--num-layers L`` keeps the first L layers (plus the final
    norm and lm_head), e.g. a draft for speculative decoding made from the target itself."""
    return dataclasses.replace(spec, num_layers=opts.num_layers) if opts.num_layers else spec


def kv_cache_bytes(
    spec: ModelSpec, plan: ExportPlan, slots: int | None = None, per_rank: bool = False
) -> int:
    """K and V bytes for ``slots`` cache positions per sequence (default: the whole cache),
    summed over ranks (replicated and padded KV heads included) unless ``per_rank``."""
    slots = plan.sequence_length if slots is None else slots
    kv = shard_layout(spec, plan.tp).kv * (1 if per_rank else plan.tp)
    per_slot = 2 * spec.num_layers * kv * spec.head_dim * DTYPE_BYTES[plan.kv_format]
    return plan.batch_size * slots * per_slot
