"""Compile backends: what turns one bucket of the decoder into files, and those files back into a
callable graph.

A backend builds a bucket from the model (it traces as it needs to), writes one or more files
per bucket, names the cache namespace and key parts that decide its code, and loads the files
with the rank's weights and KV caches (``GraphState``). ``inductor`` (torch.export +
AOTInductor, CPU or CUDA) is the default; ``xla`` (torch.export -> StableHLO on torch-xla's CPU
client) runs in its own environment (``make test-xla``); ``neuron`` (NxD trace / compile ->
NEFF, run by one NxDModel for every rank) needs the AWS Neuron SDK. docs/backends.md and
docs/neuron.md say what each has been run on."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from nxdc.buckets import Bucket
from nxdc.errors import UnsupportedError, UserInputError
from nxdc.plan import ExportPlan

NAMES = ("inductor", "xla", "neuron")
# Backends whose runtime drives every rank of a tp > 1 export from one process (neuron: one
# NxDModel(world_size=tp) fed every rank's weights); the others run one process per rank.
IN_PROCESS_TP = ("neuron",)


@dataclass
class GraphState:
    """One rank's tensors that every graph of an export shares, by graph constant name: weights,
    rope tables, and the KV caches ``kv`` (in the order functional graphs return them). A
    functional graph's new caches replace these entries (``update_kv``): the next graph, of any
    bucket, reads them."""

    tensors: dict[str, torch.Tensor]
    kv: list[str]
    tp: int = 1
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


def get_backend(name: str, device: str = "cpu") -> Backend:
    if name == "inductor":
        from nxdc.compile.backends.inductor import InductorBackend

        return InductorBackend(device)
    if name == "xla":
        from nxdc.compile.backends.xla import XlaBackend

        return XlaBackend(device)
    if name == "neuron":
        from nxdc.compile.backends.neuron import NeuronBackend

        return NeuronBackend(device)
    raise UserInputError(f"unknown backend {name!r} (known: {', '.join(NAMES)})")


def check_device(device: str) -> str:
    if device == "cpu":
        return device
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise UnsupportedError(f"--device {device}: no CUDA device is available on this machine")
        return device
    raise UserInputError(f"--device must be cpu or cuda[:N] (got {device!r})")
