"""ExportPlan: ModelSpec + options -> everything an export will do. Every "can't shard",
"won't fit" and "bad option" error is raised here, before any weight is read."""

from __future__ import annotations

import dataclasses
import json
import os
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nxdc.archs import spec_from_config
from nxdc.buckets import Bucket, context_buckets
from nxdc.errors import UnsupportedError, UserInputError
from nxdc.model import weight_format
from nxdc.model.sharding import check_tp, shard_layout
from nxdc.spec import ModelSpec

DTYPES = ("fp32", "bf16")
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
KV_FORMATS = ("fp32", "fp16", "bf16")
BACKENDS = ("inductor", "xla", "neuron")
# How each backend's graphs write the KV cache (the first is its default): ``in-place`` with
# ``index_copy_`` on the cache buffers; ``functional``: the new cache is re-assigned and handed
# back by the graph (ModelBuilder and XLA alias it to the input; inductor copies it back).
KV_UPDATES = {"inductor": ("in-place", "functional"), "xla": ("functional",), "neuron": ("functional",)}
# ExportOptions that hold a list of integers (comma-separated on the command line)
LIST_OPTIONS = ("context_buckets", "decode_buckets", "chunk_buckets", "decode_batch_sizes")


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
    speculation_length: int = 0  # K > 0: add verify graphs (K+1 tokens per call) for speculation
    weights: str | None = None  # storage of linear-layer weights (model/weight_format.py; default: dtype)
    kv_cache: str | None = None  # storage of the KV cache: fp32 | fp16 | bf16 (default: stored_kv_cache)
    num_layers: int | None = None  # keep only the first L layers (a self-draft for speculation)
    # `nxdc serve`: single-row prefill graphs of these chunk lengths (docs/serve.md)
    chunk_buckets: tuple[int, ...] | None = None
    # decode graphs that step only this many of the batch's rows (fewer busy rows: cheaper steps)
    decode_batch_sizes: tuple[int, ...] | None = None
    kv_update: str | None = None  # in-place | functional (default: the backend's, KV_UPDATES)

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
    kv_update: str | None = None  # "functional": graphs return their new KV caches (None: in place)
    weight_map: dict[str, str] | None = None  # weights "gguf": module -> format (model/weight_format.py)

    @property
    def host_device(self) -> str:
        """The torch device the plan's decoder is traced on and its weights loaded on: ``device``,
        except under the neuron backend, whose ``--device`` (trn1 | trn2 | inf2) is a compile
        target; its tensors stay on the CPU and NxDModel.set_weights moves them to the device."""
        return "cpu" if self.backend == "neuron" else self.device

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


def _positive(name: str, value: int) -> None:
    if not isinstance(value, int) or value < 1:
        raise UserInputError(f"--{name.replace('_', '-')} must be a positive integer (got {value!r})")


DEFAULT_SEQUENCE_LENGTH = 1024


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
    if opts.backend not in BACKENDS:
        raise UserInputError(f"--backend must be one of {', '.join(BACKENDS)} (got {opts.backend!r})")
    kv_update = _kv_update(opts)
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
        kv_update=None if kv_update == "in-place" else kv_update,
    )


def _kv_update(opts: ExportOptions) -> str:
    allowed = KV_UPDATES[opts.backend]
    mode = opts.kv_update or allowed[0]
    if mode not in allowed:
        raise UserInputError(
            f"--kv-update {mode}: the {opts.backend} backend writes the KV cache {' or '.join(allowed)}"
        )
    if opts.backend == "xla" and opts.tp > 1:
        raise UnsupportedError(
            "--backend xla runs on torch-xla's CPU client, one device: tensor parallelism (--tp "
            f"{opts.tp}) is not supported there; use --tp 1, or --backend inductor for --tp > 1"
        )
    if opts.backend == "xla" and opts.device != "cpu":
        raise UserInputError(f"--backend xla runs on XLA:CPU: use --device cpu (got {opts.device!r})")
    return mode


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


def _stored_format(value: str | None, dtype: str, choices: tuple[str, ...], flag: str) -> str | None:
    """A storage flag's value, None where it is the compute dtype (the default)."""
    if value is None or value == dtype:
        return None
    if value not in choices:
        raise UserInputError(f"{flag} must be one of {', '.join(choices)} (got {value!r})")
    return value


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
