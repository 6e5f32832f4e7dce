"""What names a compiled graph in the compile cache: its key parts (everything that decides
the code a backend produces) and the namespace (backend, device, torch, ISA) it lives in. Export
and the cache commands both compute keys here, so they always agree."""

from __future__ import annotations

import json
from typing import Any

from nxdc.buckets import PROMPT_KINDS, Bucket
from nxdc.cache.keys import canonical, digest, model_code_digest
from nxdc.compile.trace import kernels_apply
from nxdc.kernels import kernel_digest, kernel_entry
from nxdc.plan import ExportPlan
from nxdc.spec import ModelSpec


def key_parts(
    spec: ModelSpec, plan: ExportPlan, bucket: Bucket, backend, kernels: str | None
) -> dict[str, Any]:
    """What makes a compiled graph. No rank: under tensor parallelism every rank runs the same
    graph (SPMD; weights and KV caches are handed in at load time), so one artifact per bucket
    serves every rank."""
    return {
        "kernels": kernels,
        "model": spec.to_dict(),
        "bucket": bucket.name,
        "batch_size": plan.batch_size,
        "sequence_length": plan.sequence_length,
        "dtype": plan.dtype,
        **({"weights": plan.weights} if plan.weights else {}),
        **({"weight_map": plan.weight_map} if plan.weight_map else {}),
        **({"kv_cache": plan.kv_cache} if plan.kv_cache else {}),
        **({"kv_update": plan.kv_update} if plan.kv_update != "in-place" else {}),  # keys as before
        # only prompt graphs multiply on tiles, only decode / verify graphs on int8 activations:
        # each setting keys only its own graphs, which the others share
        **_matmul_part(plan, bucket),
        "tp": plan.tp,
        **({"speculation_length": plan.speculation_length} if bucket.kind == "verify" else {}),
        "code": model_code_digest(),
        **backend.key_parts(bucket.kind),
    }


def namespace(backend) -> str:
    p = backend.key_parts()
    return f"{p['backend']}-{p['device']}-{p['torch']}-{p['isa']}".replace("/", "_").replace(" ", "")


def graph_entries(spec: ModelSpec, plan: ExportPlan, backend) -> dict[tuple[str, str], dict[str, Any]]:
    """{(namespace, key): key parts} of every cache entry an export of ``plan`` uses: one per
    bucket, plus the CPU kernel library when its graphs call it. Nothing is traced."""

    kernels = kernel_digest() if kernels_apply(plan) else None
    out = {}
    if kernels:  # the kernel library the graphs call travels with them
        k_ns, k_key, k_parts = kernel_entry()
        out[(k_ns, k_key)] = json.loads(canonical(k_parts))
    ns = namespace(backend)
    for bucket in plan.buckets:
        parts = key_parts(spec, plan, bucket, backend, kernels)
        out[(ns, digest(parts))] = json.loads(canonical(parts))
    return out


def _matmul_part(plan: ExportPlan, bucket: Bucket) -> dict[str, str]:
    """The key part of how the graph's kernel Linears multiply (nothing where exactly, as
    before these options)."""
    name, value = (
        ("prefill_matmul", plan.prefill_matmul)
        if bucket.kind in PROMPT_KINDS
        else ("decode_matmul", plan.decode_matmul)
    )
    return {name: value} if value != "exact" else {}
