"""AWS Neuron (Trainium / Inferentia) through neuronx-distributed's ModelBuilder v2 (Neuron SDK
2.31: torch-neuronx 2.9, neuronx-cc 2.26, neuronx-distributed 0.19). NEVER RUN: no Neuron SDK
or device was reachable where this was written; docs/neuron.md says what each call rests on.

Build, per bucket, under ``NxDParallelState(world_size=tp)``: ``trace`` (lazy-tensor HLO on
the CPU; the KV caches are re-assigned buffers, which ModelBuilder aliases itself; collectives
traced as ``xm.all_reduce`` over every rank) then ``compile`` (neuronx-cc, ``--target`` = the
export's ``--device``). The cache entry holds the NEFF and the pickled trace artifacts (HLO,
metaneff, input flattener / output packer) that ``NxDModel.add`` needs to rebuild it.

Run (tp 1): every bucket of the export is added to ONE ``NxDModel``, so all buckets share its
device-resident KV state; the rank's weights go in through ``set_weights``, and each call
returns the logits to the host, where nxdc samples."""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from nxdc.cache.keys import source_digest
from nxdc.compile.backends import Graph, GraphState
from nxdc.compile.buckets import Bucket
from nxdc.compile.trace import example_inputs, graph_for
from nxdc.errors import UnsupportedError, UserInputError
from nxdc.model.parallel import xla_collectives
from nxdc.plan import ExportPlan

TARGETS = ("trn1", "trn2", "inf2")
# Neuron SDK 2.31.1 (aws-neuron-sdk src/helperscripts/n2-manifest.json)
PACKAGES = {
    "torch-neuronx": "2.9.0.2.15.32035",
    "neuronx-cc": "2.26.6360.0",
    "neuronx-distributed": "0.19.28492",
    "libneuronxla": "2.2.17544.0",
    "torch": "2.9.0",
}
MODULES = {
    "torch_neuronx": "torch-neuronx",
    "neuronxcc": "neuronx-cc",
    "neuronx_distributed": "neuronx-distributed",
    "libneuronxla": "libneuronxla",
}
INDEX = "https://pip.repos.neuron.amazonaws.com"
INSTALL = f"pip install --extra-index-url {INDEX} " + " ".join(f"{p}=={v}" for p, v in PACKAGES.items())
NEFF, TRACE = "graph.neff", "trace.pt"


def missing_packages() -> list[str]:
    return [pip for mod, pip in MODULES.items() if importlib.util.find_spec(mod) is None]


class NeuronBackend:
    name = "neuron"

    def __init__(self, device: str = "trn1"):
        missing = missing_packages()
        if missing:
            raise UnsupportedError(
                f"the neuron backend needs the AWS Neuron SDK 2.31 ({', '.join(missing)} not installed; "
                f"the PyPI packages of those names are empty placeholders): {INSTALL} (docs/neuron.md)"
            )
        if device not in TARGETS:
            raise UserInputError(
                f"--backend neuron compiles for --device {' | '.join(TARGETS)} (got {device!r})"
            )
        self.device = device

    def compiler_args(self) -> str:
        """neuronx-cc flags: ``NXDC_NEURON_CC_FLAGS`` (default: fp32 kept, -O1), then --target."""
        flags = os.environ.get("NXDC_NEURON_CC_FLAGS", "--auto-cast=none --model-type=transformer -O1")
        return f"{flags} --target {self.device}"

    def key_parts(self, kind: str | None = None) -> dict[str, Any]:
        import neuronx_distributed
        import neuronxcc

        return {
            "backend": self.name,
            "device": self.device,
            "torch": torch.__version__,
            "isa": f"neuronx-cc-{neuronxcc.__version__}-nxd-{neuronx_distributed.__version__}",
            "flags": self.compiler_args(),
            "backend_code": source_digest(Path(__file__).resolve()),
        }

    def build(self, model, bucket: Bucket, plan: ExportPlan, out_dir: Path) -> None:
        from neuronx_distributed import NxDParallelState
        from neuronx_distributed.trace.functions import compile as nxd_compile
        from neuronx_distributed.trace.functions import trace as nxd_trace

        graph = graph_for(model, bucket, plan.speculation_length, return_kv=False)
        args = example_inputs(bucket, plan.batch_size, "cpu", plan.speculation_length)
        lnc = 2 if self.device == "trn2" else 1
        with (
            NxDParallelState(world_size=plan.tp, tensor_model_parallel_size=plan.tp, lnc_size=lnc),
            xla_collectives(),
            tempfile.TemporaryDirectory(dir=out_dir.parent) as work,
        ):
            traced = nxd_trace(graph, args=args)
            compiled = nxd_compile(
                traced.hlo,
                traced.metaneff,
                compiler_workdir=work,
                compiler_args=self.compiler_args(),
                key=bucket.name,
            )
            shutil.copyfile(compiled.neff_filepath, out_dir / NEFF)
            torch.save(traced, out_dir / TRACE)

    def export_path(self, bucket: str, file: str) -> str:
        return f"artifacts/{bucket}/{file}"

    def place(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return tensors  # NxDModel.set_weights moves them (first call)

    def load(self, name: str, files: dict[str, Path], state: GraphState, inputs) -> Graph:
        return NeuronGraph(name, files, state, inputs)


class NeuronGraph(Graph):
    """One bucket of the export's single NxDModel (built and sent to the device on the first
    call, once every bucket was added)."""

    def __init__(self, name: str, files: dict[str, Path], state: GraphState, inputs):
        from neuronx_distributed import NxDModel
        from neuronx_distributed.trace.model_builder_utils import CompilationArtifacts

        super().__init__(name, inputs, "cpu")
        if state.tp > 1:
            raise UnsupportedError(
                "running a neuron export with --tp > 1 needs one process driving every rank "
                "(NxDModel.set_weights with each rank's weights): not implemented in this nxdc"
            )
        model = state.extra.setdefault("neuron_model", NxDModel(world_size=1))
        traced = torch.load(files[TRACE], weights_only=False)
        model.add(name, traced, CompilationArtifacts(os.fspath(files[NEFF])))
        self._state = state

    def __call__(self, *arrays: torch.Tensor) -> torch.Tensor:
        self.check(arrays)
        model = self._state.extra["neuron_model"]
        if not self._state.extra.get("neuron_loaded"):  # every bucket is added by now
            kv = set(self._state.kv)
            model.set_weights([{n: t for n, t in self._state.tensors.items() if n not in kv}])
            model.to_neuron()  # KV states start as zeros on the device
            self._state.extra["neuron_loaded"] = True
        out = model(*[a.to(torch.int64).contiguous() for a in arrays], model_name=self.name)
        return (out[0] if isinstance(out, (tuple, list)) else out).cpu()
