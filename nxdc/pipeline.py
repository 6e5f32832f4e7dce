"""The export pipeline: resolve -> spec -> plan -> weights -> trace -> compile (cached) -> write.

Plain functions; the CLI only parses options, calls ``run_export`` and renders the result."""

from __future__ import annotations

import dataclasses
import json
import os
import resource
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

import nxdc
from nxdc.archs import get_arch, spec_from_config
from nxdc.buckets import Bucket
from nxdc.cache.keys import digest, sha256_file
from nxdc.cache.store import CompileCache, entry_files
from nxdc.compile.backends.registry import get_backend, host_device
from nxdc.compile.graph_keys import key_parts, namespace
from nxdc.compile.planning import make_plan
from nxdc.compile.trace import (
    build_decoder,
    input_specs,
    kernels_apply,
    meta_decoder,
    rank_weight_bytes,
    wants_kernels,
    weight_bytes,
)
from nxdc.errors import UnsupportedError, UserInputError
from nxdc.kernels import LIBRARY, kernel_digest, loaded_library
from nxdc.manifest import MANIFEST, Artifact, FileRef, Manifest
from nxdc.model import weight_format
from nxdc.model.dtypes import TORCH_DTYPES
from nxdc.model.fused import checkpoint_targets, combine, part_shape
from nxdc.model.layers import Embedding, Linear
from nxdc.model.quant import quantize_int4, quantize_int8
from nxdc.model.sharding import expert_intermediate, shard_layout
from nxdc.plan import ExportOptions, ExportPlan, kv_cache_bytes, planned_spec
from nxdc.progress import NullReporter, Reporter
from nxdc.spec import ModelSpec
from nxdc.sync.registry import record_export
from nxdc.weights.gguf_quant import requantize
from nxdc.weights.safetensors_io import SafetensorsWriter
from nxdc.weights.shard import rank_tensor
from nxdc.weights.sources import ModelSource, resolve


@dataclass
class BucketResult:
    name: str
    key: str
    hit: bool
    reason: str
    seconds: float


@dataclass
class ExportResult:
    """What an export did (``nxdc.export``, ``run_export``; ``nxdc export --json`` prints
    ``to_dict()``): the directory written, the model and plan it holds (as in its manifest),
    each graph's cache hit or compile, the time and the peak memory it took."""

    out: Path  # the export directory
    spec: ModelSpec
    plan: ExportPlan
    buckets: list[BucketResult] = field(default_factory=list)
    seconds: float = 0.0
    peak_rss_mib: float = 0.0  # this process's, or a compiler child's if larger (Linux: KiB units)
    accuracy: dict[str, Any] | None = None  # check_accuracy: nxdc.accuracy.measure's report

    @property
    def cache_hits(self) -> int:
        return sum(b.hit for b in self.buckets)

    @property
    def compiled(self) -> int:
        return sum(not b.hit for b in self.buckets)

    def to_dict(self) -> dict[str, Any]:
        d = {
            "out": str(self.out),
            "plan": self.plan.to_dict(),
            "buckets": [vars(b) for b in self.buckets],
            "cache_hits": self.cache_hits,
            "compiled": self.compiled,
            "seconds": round(self.seconds, 2),
            "peak_rss_mib": round(self.peak_rss_mib, 1),
        }
        return d if self.accuracy is None else {**d, "accuracy": self.accuracy}


def prepare(
    model: str, opts: ExportOptions, cache_root: Path | None = None
) -> tuple[ModelSource, dict, ModelSpec, ExportPlan]:
    """Resolve, map the config and validate the plan: everything that can fail fast."""
    src = resolve(model, cache_root)
    cfg = src.config()
    spec = spec_from_config(cfg)
    plan = make_plan(spec, opts)
    get_backend(plan.backend, plan.device)  # refuses an unavailable backend or device now
    spec = planned_spec(spec, opts)
    if plan.weights == weight_format.AUTO or keeps_gguf_by_default(src, opts, plan):
        keep = src.kind == "gguf"  # a GGUF file's own formats, else the compute dtype
        plan = dataclasses.replace(
            plan,
            weights=weight_format.GGUF if keep else None,
            weight_map=gguf_weight_map(src, spec, plan) if keep else None,
        )
    if opts.num_layers:  # the export's config.json describes the model it holds
        cfg = {**cfg, "num_hidden_layers": opts.num_layers}
    return src, cfg, spec, plan


def keeps_gguf_by_default(src: ModelSource, opts: ExportOptions, plan: ExportPlan) -> bool:
    """Whether an export that names no ``--weights`` keeps a GGUF file's quantized tensors as
    stored (``--weights auto``): at ``--dtype fp32`` where nxdc's CPU kernels read the stored
    formats. Elsewhere (CUDA, XLA, no AVX2) a kept weight would be converted on every call, so
    the file is dequantized into the compute dtype once, at export."""
    return src.kind == "gguf" and opts.weights is None and plan.dtype == "fp32" and kernels_apply(plan)


def gguf_weight_map(src: ModelSource, spec: ModelSpec, plan: ExportPlan) -> dict[str, str]:
    """``--weights auto`` on a GGUF file: {Decoder module: format} for every linear layer and the
    embedding whose GGUF types nxdc keeps as stored (``weights/gguf_quant.py``; a fused q/k/v or
    gate/up takes one format that holds all its parts), where every rank's cut of its inputs falls
    on a group boundary. Modules left out are dequantized into the compute dtype."""
    from nxdc.weights.gguf_quant import common_format, kept_format

    arch = get_arch(spec.arch)
    checkpoint = meta_decoder(spec, dataclasses.replace(plan, tp=1, weights=None, weight_map=None))
    ranked = meta_decoder(spec, dataclasses.replace(plan, weights=None, weight_map=None))
    targets = checkpoint_targets(checkpoint)
    parts: dict[str, list] = {}
    for hf_name, t in src.tensors(spec):
        name = arch.weight_name(hf_name)
        target = targets.get(name) if name is not None else None
        if target is None or not target.stored.endswith(".weight") or target.experts:
            continue
        module = target.stored.rpartition(".")[0]
        if module.endswith("router") or not isinstance(checkpoint.get_submodule(module), (Linear, Embedding)):
            continue
        parts.setdefault(module, [None] * target.count)[target.index] = kept_format(t.type_name)
    out = {}
    for module, formats in parts.items():
        f = common_format(formats)
        if f is None:
            continue
        k = ranked.get_submodule(module).weight.shape[1]  # per rank
        if f.scales == "k" and (module == "embed_tokens" or f.check_inputs(k, module)):
            # the same values with one fp32 scale (and min) a group: an embedding lookup dequantizes
            # in PyTorch ops, and a rank's cut must fall on a super-block for two-level scales
            f = dataclasses.replace(f, scales="f32")
        if f.check_inputs(k, module) is None:
            out[module] = f.name
    if spec.tie_word_embeddings and "embed_tokens" in out:  # the lm_head is the embedding
        out["lm_head"] = out["embed_tokens"]
    return out


def write_weights(src: ModelSource, spec: ModelSpec, plan: ExportPlan, rank: int, path: Path) -> FileRef:
    """Map, shard, cast and check every tensor for one rank; write its safetensors file in the
    runtime dtype, tensor by tensor (``weights/safetensors_io.py``): holds one source tensor at a time,
    plus the parts of a fused q/k/v or gate/up until the last arrives."""
    arch = get_arch(spec.arch)
    if src.kind == "gguf" and not arch.gguf:  # GGUF names/permutations are mapped for Llama only
        raise UnsupportedError(
            f"{src.name}: GGUF files of {spec.arch} models are not supported; use its safetensors checkpoint"
        )
    layout = shard_layout(spec, plan.tp)
    tp1 = shard_layout(spec, 1)
    checkpoint = meta_decoder(spec, dataclasses.replace(plan, tp=1, weights=None))
    full = checkpoint.state_dict()  # checkpoint shapes
    targets = checkpoint_targets(checkpoint)
    meta = meta_decoder(spec, plan).stored_state()  # what is stored (quantized: + scales, mins)
    dense = meta_decoder(spec, dataclasses.replace(plan, weights=None)).stored_state()
    expected = {n: tuple(p.shape) for n, p in dense.items()}  # this rank's shapes before quantizing
    dtype = TORCH_DTYPES[plan.dtype]
    parts: dict[str, dict[int, torch.Tensor]] = {}  # combined name -> this rank's parts so far
    with SafetensorsWriter(path, meta, metadata={"format": "pt"}) as out:
        for hf_name, t in src.tensors(spec):
            name = arch.weight_name(hf_name)
            target = targets.get(name) if name is not None else None
            if target is None or target.stored not in expected:
                continue
            stored = target.stored
            want = part_shape(target, spec, tp1, tuple(full[stored].shape))
            if tuple(t.shape) != tuple(want):
                raise UserInputError(
                    f"{src.name}: weight {hf_name} has shape {tuple(t.shape)}, the config implies {tuple(want)}"
                )
            module = stored.rpartition(".")[0]
            fmt = weight_format.module_format(plan.weights, module, plan.weight_map) if plan.weights else None
            kept = plan.weights == weight_format.GGUF and fmt is not None and stored.endswith(".weight")
            if kept:  # values, scales and mins through the same cuts ([rows, K, 3])
                t = t.with_params()
            w = rank_tensor(target.role, name.rpartition(".")[2], t, spec, layout, rank).to(dtype)
            if target.count > 1:  # a q/k/v, gate/up or expert part (model/fused.py)
                got = parts.setdefault(stored, {})
                got[target.index] = w
                if len(got) < target.count:
                    continue
                w = combine(target, [got[i] for i in range(target.count)])
                del parts[stored]
            if kept:
                w, s, m = w.unbind(-1)
            if tuple(w.shape) != expected[stored]:  # a sharding bug, not a user error
                raise AssertionError(f"{stored}: rank {rank} shard {tuple(w.shape)} != {expected[stored]}")
            if kept:
                q, scale, mins = requantize(w, s, m, weight_format.parse(fmt), f"{src.name}: {hf_name}")
                tensors = _quantized(stored, q, scale, mins)
            else:
                tensors = stored_tensors(stored, w, meta[stored].dtype, fmt)
            for n, v in tensors.items():
                out.write(n, v)
        missing = sorted(set(meta) - out.done)
        if missing:
            raise UserInputError(f"{src.name}: weights missing from the checkpoint: {', '.join(missing[:5])}")
    return FileRef(path=path.name, bytes=path.stat().st_size, sha256=sha256_file(path))


def copy_kernel_library(export_dir: Path) -> FileRef:
    """A copy of the loaded kernel library in the export (generate loads it, not whatever build
    the installed nxdc has: the graphs call exactly the kernels they were compiled against)."""
    _, lib = loaded_library()
    dest = export_dir / "kernels" / LIBRARY
    dest.parent.mkdir()
    shutil.copy2(lib, dest)
    return FileRef(path=f"kernels/{LIBRARY}", sha256=sha256_file(dest), bytes=dest.stat().st_size)


def stored_tensors(
    name: str, w: torch.Tensor, dtype: torch.dtype, fmt: str | None
) -> dict[str, torch.Tensor]:
    """A weight as the model stores it (``dtype``: its parameter's): cast, or quantized in the
    plan's format ``fmt`` with its ``scale`` (and ``min``) beside it (``--weights``, docs/weights.md)."""
    if dtype not in (torch.int8, torch.uint8):
        return {name: w.to(dtype).contiguous()}
    f = weight_format.parse(fmt)
    if f.kind == "int4":
        q, scale, mins = quantize_int4(w, f.group, f.asym, f.scales)
    else:
        q, scale = quantize_int8(w, f.group, f.scales)
        mins = None
        if f.asym:
            raise UnsupportedError(f"--weights {fmt}: int8 with mins is kept from GGUF files only")
    return _quantized(name, q, scale, mins)


def _quantized(
    name: str, q: torch.Tensor, scale: torch.Tensor, mins: torch.Tensor | None
) -> dict[str, torch.Tensor]:
    """A quantized weight's stored tensors: ``name``, and its module's ``scale`` (and ``min``)."""
    base = name.rpartition(".")[0]
    return {name: q, f"{base}.scale": scale, **({f"{base}.min": mins} if mins is not None else {})}


def compile_bucket(
    cache: CompileCache,
    backend,
    spec: ModelSpec,
    plan: ExportPlan,
    bucket: Bucket,
    kernels: str | None,
    decoder_factory,
    export_dir: Path,
) -> tuple[BucketResult, dict[str, FileRef]]:
    """Cache hit: copy the entry's files. Miss: build (trace + compile) under a per-key lock,
    then cache it. Returns the files as the export holds them, by their name in the entry."""
    t0 = time.perf_counter()
    parts = key_parts(spec, plan, bucket, backend, kernels)
    key, ns = digest(parts), namespace(backend)
    found = cache.get(ns, key, parts)
    hit = found.path is not None
    reason = found.reason
    if not hit:
        with cache.lock(ns, key):
            again = cache.get(ns, key, parts)  # another export may have built it meanwhile
            if again.path is not None:
                found, hit, reason = again, True, "hit (built concurrently)"
            else:
                tmp_dir = tempfile.TemporaryDirectory(prefix="nxdc-compile-", dir=cache.root)
                with tmp_dir as tmp:
                    backend.build(decoder_factory(), bucket, plan, Path(tmp))
                    found.path = cache.put(ns, key, parts, Path(tmp))
    files = {}
    for name in entry_files(found.path):
        rel = backend.export_path(bucket.name, name)
        dest = export_dir / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        # a copy, not a hard link: the export dir must not share bytes with the cache entry
        shutil.copyfile(found.path / name, dest)
        files[name] = FileRef(path=rel, bytes=dest.stat().st_size, sha256=sha256_file(dest))
    return BucketResult(bucket.name, key, hit, reason, time.perf_counter() - t0), files


def run_export(
    model: str,
    out: str | os.PathLike,
    opts: ExportOptions,
    cache: CompileCache | None = None,
    reporter: Reporter | None = None,
) -> ExportResult:
    t0 = time.perf_counter()
    rep = reporter or NullReporter()
    out = Path(out).resolve()
    cache = cache or CompileCache()
    with rep.stage("plan"):
        src, cfg, spec, plan = prepare(model, opts, cache.root)
        _check_out_dir(out)
    backend = get_backend(plan.backend, plan.device)
    result = ExportResult(out, spec, plan)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        (tmp / "weights").mkdir()
        weights = {}
        with rep.stage("weights", total=plan.tp):
            for rank in range(plan.tp):
                rep.update(f"[bold]weights[/] rank {rank + 1}/{plan.tp}…")
                path = tmp / "weights" / f"rank{rank}.safetensors"
                weights[f"rank{rank}"] = write_weights(src, spec, plan, rank, path)
        with rep.stage("kernels"):
            t_k = time.perf_counter()
            loaded = wants_kernels(plan, cache)
            kernels = kernel_digest() if loaded else None
            kernel_library = copy_kernel_library(tmp) if kernels else None
            if loaded:
                rep.bucket_done("kernels", loaded.hit, loaded.reason, time.perf_counter() - t_k)
        with rep.stage("compile", total=len(plan.buckets)):
            artifacts = compile_graphs(cache, backend, spec, plan, kernels, tmp, rep, result.buckets)
        with rep.stage("write"):
            manifest = Manifest(
                nxdc_version=nxdc.__version__,
                torch_version=torch.__version__,
                source=src.name,
                spec=spec,
                plan=plan,
                weights=weights,
                artifacts=artifacts,
                kernels=kernels,
                kernel_library=kernel_library,
                idle_rows=True,
                created=time.time(),
            )
            _write_export(tmp, src, cfg, manifest)
            _publish(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    record_export(cache, manifest, namespace(backend))  # for `nxdc cache lookup`; never fails the export
    result.seconds = time.perf_counter() - t0
    usage = (resource.getrusage(who).ru_maxrss for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
    result.peak_rss_mib = max(usage) / 1024
    return result


def compile_graphs(
    cache: CompileCache,
    backend,
    spec: ModelSpec,
    plan: ExportPlan,
    kernels: str | None,
    export_dir: Path,
    rep: Reporter,
    done: list[BucketResult],
) -> dict[str, Artifact]:
    """Every bucket's graph into ``export_dir`` (``compile_bucket``: a cache hit, or traced and
    compiled from one decoder built on the first miss), reported and appended to ``done``."""
    decoder = None

    def factory():
        nonlocal decoder
        if decoder is None:
            decoder = build_decoder(spec, plan, host_device(plan), kernels is not None)
        return decoder

    artifacts = {}
    for bucket in plan.buckets:
        rep.bucket_start(bucket.name)
        br, files = compile_bucket(cache, backend, spec, plan, bucket, kernels, factory, export_dir)
        rep.bucket_done(br.name, br.hit, br.reason, br.seconds)
        done.append(br)
        artifacts[bucket.name] = Artifact(
            files=files,
            key=br.key,
            inputs=tuple(input_specs(bucket, plan.batch_size, plan.speculation_length)),
        )
    return artifacts


def _write_export(tmp: Path, src: ModelSource, cfg: dict, manifest: Manifest) -> None:
    """The config, tokenizer and generation config beside the weights and graphs, then the
    manifest, last: a directory without it is never taken as an export."""
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2, default=str))
    src.save_tokenizer(tmp)
    if src.kind == "hf" and (src.path / "generation_config.json").is_file():
        shutil.copy2(src.path / "generation_config.json", tmp / "generation_config.json")
    manifest.write(tmp)


def _check_out_dir(out: Path) -> None:
    if out.exists() and not out.is_dir():
        raise UserInputError(f"output {out} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not (out / MANIFEST).is_file():
        raise UserInputError(
            f"output directory {out} is not empty and is not an nxdc export: refusing to replace it"
        )


def _publish(tmp: Path, out: Path) -> None:
    """Swap the finished temp dir into place; an old export is replaced only once the new one
    is complete."""
    for p in [tmp, *tmp.rglob("*")]:
        p.chmod(0o755 if p.is_dir() else 0o644)
    old = None
    if out.exists():
        old = out.parent / f".{out.name}.old-{os.getpid()}"
        os.rename(out, old)
    os.rename(tmp, out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def plan_summary(model: str, spec, plan) -> dict:
    """What ``--dry-run`` reports: the plan, its sharding and its memory, per rank and in all."""
    layout = shard_layout(spec, plan.tp)
    rank_w, rank_kv = rank_weight_bytes(spec, plan), kv_cache_bytes(spec, plan, per_rank=True)
    moe = {}
    if spec.is_moe:
        moe = {
            "moe": {
                "experts": spec.num_experts,
                "experts_per_token": spec.experts_per_token,
                "active_params": spec.param_count(active=True),
                "expert_intermediate_per_rank": expert_intermediate(spec, plan.tp),
            }
        }
    return {
        "model": model,
        "arch": spec.arch,
        "params": spec.param_count(),
        **moe,
        "plan": plan.to_dict(),
        "weight_bytes": weight_bytes(spec, plan),
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
