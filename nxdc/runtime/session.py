"""A loaded export: weights once, every bucket graph sharing them, a static KV cache. The
backend (``compile/backends``) turns each bucket's files into a callable graph."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from nxdc.cache.keys import sha256_file
from nxdc.compile.backends.base import Graph, GraphState
from nxdc.compile.backends.registry import host_device, rules
from nxdc.errors import ExportDirError
from nxdc.kernels import load_export_library
from nxdc.manifest import Manifest, load_manifest
from nxdc.model.decoder import GRAPH_PREFIX, kv_cache_names, runtime_constants, tie_lm_head
from nxdc.model.dtypes import TORCH_DTYPES
from nxdc.model.sharding import shard_layout
from nxdc.runtime.arena import HostArena
from nxdc.runtime.threads import apply_threads
from nxdc.weights.safetensors_io import read_into, read_layout
from nxdc.weights.shard import tied_lm_head


class Session:
    """One rank's loaded export (the whole model at tp 1): its weights and KV cache, once, and
    every bucket graph sharing them. What callers use is a ``Runner`` (``runner.py``), which
    owns a Session, picks the graph for each request and, under tensor parallelism, keeps the
    ranks' Sessions in step (``workers.py``)."""

    def __init__(
        self,
        export_dir: str | Path,
        threads: int | None = None,
        verify: bool = True,
        rank: int = 0,
        manifest: Manifest | None = None,
    ):
        self.dir = Path(export_dir)
        self.manifest = manifest or load_manifest(self.dir)
        self.spec, self.plan = self.manifest.spec, self.manifest.plan
        self.rank = rank
        self.layout = shard_layout(self.spec, self.plan.tp)
        self.threads = apply_threads(threads)
        self.device = host_device(self.plan)  # where tensors are loaded (neuron: cpu, not its target)
        backend_rules = rules(self.plan.backend)
        backend = backend_rules.create(self.plan.device)
        if self.manifest.kernels:  # graphs call nxdc::linear_* / attend: load the library
            load_export_library(self.dir, self.manifest.kernels, self.manifest.kernel_library, verify)
        self.state = GraphState(
            backend.place(self._constants()),
            [GRAPH_PREFIX + n for n in kv_cache_names(self.spec)],
            tp=self.plan.tp,
            kv_update=self.plan.kv_update,
        )
        if self.plan.tp > 1 and backend_rules.in_process_tp:  # one process feeds every rank
            others = [backend.place(self._constants(r)) for r in range(1, self.plan.tp)]
            self.state.extra["ranks"] = [self.state.tensors, *others]
        self.graphs: dict[str, Graph] = {}
        for name, art in self.manifest.artifacts.items():
            files = {}
            for fname, ref in art.files.items():
                path = files[fname] = self.dir / ref.path
                if not path.is_file():
                    raise ExportDirError(
                        f"{self.dir}: compiled artifact {ref.path} is missing: re-run nxdc export"
                    )
                if verify and sha256_file(path) != ref.sha256:
                    raise ExportDirError(
                        f"{self.dir}: compiled artifact {ref.path} is corrupt (sha256 mismatch)"
                    )
            try:
                self.graphs[name] = backend.load(name, files, self.state, art.inputs)
            except RuntimeError as e:  # e.g. a graph calling a kernel op this nxdc no longer has
                first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                where = ", ".join(ref.path for ref in art.files.values())
                raise ExportDirError(
                    f"{self.dir}: compiled artifact {where} cannot be loaded by this nxdc "
                    f"({first}): re-run nxdc export"
                ) from e

    @property
    def constants(self) -> dict[str, torch.Tensor]:
        """The rank's weights, rope tables and KV caches by graph constant name."""
        return self.state.tensors

    def _constants(self, rank: int | None = None) -> dict[str, torch.Tensor]:
        rank = self.rank if rank is None else rank
        info = self.manifest.rank_weights(rank)
        path = self.dir / "weights" / (info.path if info else f"rank{rank}.safetensors")
        if info is None or not path.is_file() or path.stat().st_size != info.bytes:
            raise ExportDirError(
                f"{self.dir}: weights file {path.name} is missing or truncated: re-run nxdc export"
            )
        s, p = self.spec, self.plan
        kv_shape = (p.batch_size, self.layout.kv, p.sequence_length, s.head_dim)  # as Attention's buffers
        kv_dtype = TORCH_DTYPES[p.kv_format]
        kv_names = kv_cache_names(s)
        if self.plan.device == "cpu":  # weights + KV cache on huge pages (arena.py), read straight in
            try:
                layout = read_layout(path)  # read the header once: sizes the arena, then the reads
                self.arena = HostArena(
                    HostArena.bytes_for((shape, dtype) for dtype, shape, _, _ in layout[0].values())
                    + HostArena.bytes_for([(kv_shape, kv_dtype)] * len(kv_names))
                )
                state = read_into(path, self.arena.empty, layout)
            except ValueError as e:
                raise ExportDirError(f"{self.dir}: {e}: re-run nxdc export") from None
            state.update({n: self.arena.zeros(kv_shape, kv_dtype) for n in kv_names})
        else:
            self.arena = None
            state = load_file(str(path), device=self.device)
            state.update({n: torch.zeros(kv_shape, dtype=kv_dtype, device=self.device) for n in kv_names})
        if s.tie_word_embeddings:
            tie_lm_head(state, lambda t: tied_lm_head(t, self.layout, rank))
        state.update(runtime_constants(s, p.sequence_length, rank, p.tp, self.device))
        return {GRAPH_PREFIX + k: v for k, v in state.items()}

    @property
    def batch_size(self) -> int:
        return self.plan.batch_size

    @property
    def max_seq(self) -> int:
        return self.plan.sequence_length

    @property
    def speculation_length(self) -> int:
        """K of the export's verify graphs (0: the export cannot verify draft tokens)."""
        return self.plan.speculation_length
