"""Trace one bucket's graph with torch.export.

The decoder is built on the meta device and materialised uninitialised (``to_empty``): tracing
needs shapes and dtypes, not values, and the real weights are handed in at load time."""

from __future__ import annotations

import contextlib
import dataclasses

import torch

from nxdc.buckets import Bucket
from nxdc.compile.backends.registry import rules
from nxdc.kernels import KernelLoad, cpu_supported, disabled, ensure_loaded
from nxdc.model.decoder import ContextEncoding, Decoder, FunctionalKV, RowPrefill, TokenGeneration, Verify
from nxdc.model.dtypes import TORCH_DTYPES
from nxdc.model.sharding import shard_layout
from nxdc.plan import ExportPlan
from nxdc.spec import ModelSpec


def meta_decoder(spec: ModelSpec, plan: ExportPlan, kernels: bool = False) -> Decoder:
    """One rank's decoder with shapes and dtypes only (no memory): for shape checks and tracing.
    Every rank has the same shapes, so one graph per bucket serves them all. ``kernels``: its
    layers call nxdc's CPU kernels."""
    with torch.device("meta"):
        return Decoder(
            spec,
            plan.batch_size,
            plan.sequence_length,
            TORCH_DTYPES[plan.dtype],
            layout=shard_layout(spec, plan.tp),
            weights=plan.weights,
            weight_map=plan.weight_map,
            kv_dtype=TORCH_DTYPES[plan.kv_format],
            kernels=kernels,
            kv_update=plan.kv_update,
            prefill_matmul=plan.prefill_matmul,
            decode_int8=plan.decode_matmul == "int8",
        )


def build_decoder(spec: ModelSpec, plan: ExportPlan, device: str, kernels: bool = False) -> Decoder:
    """One rank's decoder to trace, on ``device`` (the plan's host device), weights uninitialised."""
    return meta_decoder(spec, plan, kernels).to_empty(device=device).eval()


def kernels_apply(plan: ExportPlan) -> bool:
    """nxdc's CPU kernels are for graphs on the CPU of a backend that calls them (its
    ``cpu_kernels``: inductor; every ``--dtype``: fp16 / bf16 activations enter them as fp32), on
    CPUs with AVX2/FMA, unless disabled."""
    return rules(plan.backend).cpu_kernels and plan.device == "cpu" and cpu_supported() and not disabled()


def wants_kernels(plan: ExportPlan, cache=None) -> KernelLoad | None:
    """Whether the plan's graphs call nxdc's CPU kernels: None where they do not apply, else
    how loading them went (from ``cache``, its remote, or a build; true where they loaded)."""
    return ensure_loaded(cache) if kernels_apply(plan) else None


def graph_for(
    model: Decoder, bucket: Bucket, speculation: int = 0, return_kv: bool | None = None
) -> torch.nn.Module:
    """The bucket's graph; with functional KV writes it also returns the new caches, unless
    ``return_kv`` is False (NxD's ModelBuilder aliases re-assigned buffers itself)."""
    if bucket.kind == "context":
        graph = ContextEncoding(model)
    elif bucket.kind == "verify":
        graph = Verify(model, bucket.length, speculation)
    elif bucket.kind == "chunk":
        graph = RowPrefill(model, bucket.length)
    else:
        graph = TokenGeneration(model, bucket.length)
    if return_kv is None:
        return_kv = model.kv_update == "functional"
    return FunctionalKV(graph) if return_kv else graph


def input_specs(bucket: Bucket, batch: int, speculation: int = 0) -> list[tuple[str, tuple[int, ...]]]:
    """The graph's inputs (all int64, contiguous): AOTInductor checks neither shapes nor
    strides at run time, so the runtime feeds exactly these."""
    if bucket.kind == "context":
        return [("input_ids", (batch, bucket.length)), ("last_index", (batch,))]
    if bucket.kind == "verify":
        return [("input_ids", (batch, speculation + 1)), ("start", (batch,))]
    if bucket.kind == "chunk":
        return [("input_ids", (1, bucket.length)), ("rows", (1,)), ("start", (1,)), ("last_index", (1,))]
    if bucket.batch:
        b = bucket.batch
        return [("input_ids", (b, 1)), ("positions", (b,)), ("rows", (b,))]
    return [("input_ids", (batch, 1)), ("positions", (batch,))]


def example_inputs(bucket: Bucket, batch: int, device: str, speculation: int = 0) -> tuple[torch.Tensor, ...]:
    return tuple(
        torch.zeros(shape, dtype=torch.int64, device=device)
        for _, shape in input_specs(bucket, batch, speculation)
    )


def trace(
    model: Decoder, bucket: Bucket, batch: int, device: str, speculation: int = 0
) -> torch.export.ExportedProgram:
    args = example_inputs(bucket, batch, device, speculation)
    with torch.no_grad(), fake_process_group(model.tp):
        return torch.export.export(graph_for(model, bucket, speculation), args, strict=False)


@contextlib.contextmanager
def fake_process_group(tp: int):
    """A stand-in ``tp``-rank process group (no peers, no communication) so that the graph's
    collectives can be traced in this one process; the graphs name the default group, which
    the runtime's real gloo/NCCL group replaces."""
    import torch.distributed as dist

    if tp == 1:
        yield
        return
    if dist.is_initialized():
        if dist.get_world_size() != tp:
            raise RuntimeError(
                f"a {dist.get_world_size()}-rank process group is active; cannot trace tp {tp}"
            )
        yield
        return
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=tp)
    try:
        yield
    finally:
        dist.destroy_process_group()


def weight_bytes(spec: ModelSpec, plan: ExportPlan) -> int:
    """Bytes of the whole model's weights as stored (``--weights``: int8 plus its scales, ...);
    a decode step streams about this much (a tied embedding is read once, as the lm_head)."""
    return rank_weight_bytes(spec, dataclasses.replace(plan, tp=1))


def rank_weight_bytes(spec: ModelSpec, plan: ExportPlan) -> int:
    """Bytes of one rank's weight file: its shards (padding included) plus the replicated
    embedding and norms (a tied lm_head shard is sliced from the embedding at load time)."""
    state = meta_decoder(spec, plan).stored_state()
    return sum(t.numel() * t.element_size() for t in state.values())
