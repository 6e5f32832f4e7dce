"""What every backend implements (``Backend``) and the runtime objects it hands back: one
rank's shared tensors (``GraphState``) and a loaded bucket graph (``Graph``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from nxdc.buckets import Bucket
from nxdc.plan import ExportPlan


@dataclass
class GraphState:
    """One rank's tensors that every graph of an export shares, by graph constant name: weights,
    rope tables, and the KV caches ``kv`` (in the order functional graphs return them). A
    functional graph's new caches replace these entries (``update_kv``): the next graph, of any
    bucket, reads them."""

    tensors: dict[str, torch.Tensor]
    kv: list[str]
    tp: int = 1
    kv_update: str = "in-place"  # the plan's: "functional" graphs return their new caches
    extra: dict[str, Any] = field(default_factory=dict)  # what a backend keeps per process

    def update_kv(self, new: tuple[torch.Tensor, ...] | list[torch.Tensor]) -> None:
        if len(new) != len(self.kv):
            raise RuntimeError(f"a functional graph returned {len(new)} caches, the model has {len(self.kv)}")
        for name, t in zip(self.kv, new, strict=True):
            self.tensors[name] = t


class Graph:
    """A loaded bucket graph: checks its inputs against the traced shapes; backends run it."""

    def __init__(self, name: str, inputs, device: str):
        self.name = name
        self._inputs = [torch.zeros(tuple(shape), dtype=torch.int64, device=device) for _, shape in inputs]

    def check(self, arrays) -> None:
        if len(arrays) != len(self._inputs):
            raise ValueError(f"{self.name}: {len(arrays)} inputs, traced with {len(self._inputs)}")
        for buf, a in zip(self._inputs, arrays, strict=True):
            if tuple(a.shape) != tuple(buf.shape):
                raise ValueError(f"{self.name}: input shape {tuple(a.shape)} != traced {tuple(buf.shape)}")

    def __call__(self, *arrays: torch.Tensor) -> torch.Tensor:  # each backend's Graph runs it
        raise NotImplementedError(
            f"{type(self).__name__} is a base class: a backend's load() returns its own graph"
        )


class Backend(Protocol):
    name: str
    device: str

    def key_parts(self, kind: str | None = None) -> dict[str, Any]:
        """What decides the code this backend produces for a bucket of ``kind`` (None: the
        namespace's parts: backend, device, torch, ISA / target)."""
        ...

    def build(self, model, bucket: Bucket, plan: ExportPlan, out_dir: Path) -> None:
        """Trace and compile ``bucket`` of ``model`` (one rank's decoder, uninitialised weights)
        into files in ``out_dir`` (flat: the cache entry's files)."""
        ...

    def export_path(self, bucket: str, file: str) -> str:
        """Where the cache entry's ``file`` of ``bucket`` goes in an export directory."""
        ...

    def place(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The rank's loaded tensors on this backend's device (once per process)."""
        ...

    def load(self, name: str, files: dict[str, Path], state: GraphState, inputs) -> Graph:
        """Bucket ``name``'s files as a callable graph over ``state``."""
        ...
