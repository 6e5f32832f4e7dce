"""AWS Neuron (Trainium / Inferentia) through neuronx-distributed's trace / compile functions and
``NxDModel`` (Neuron SDK 2.31: torch-neuronx 2.9, neuronx-cc 2.26, neuronx-distributed 0.19).
NEVER RUN ON A NEURON DEVICE: no Neuron SDK or device was reachable where this was written. CI
checks the calls against a stand-in written from NxD's public source
(tests/test_neuron_contract.py); docs/neuron.md says what each rule rests on (file, function).

Build, per bucket, on the CPU (``--device trn1 | trn2 | inf2`` is the compile target, never a torch
device) under ``NxDParallelState(world_size=tp)``: the bucket's graph in ``NeuronBucket``, one
forward signature for every bucket, is traced by ``neuronx_distributed.trace.functions.trace``
(KV caches are re-assigned buffers, which it aliases as device state; collectives traced as
``xm.all_reduce`` over every rank), its weight and state names are checked against what the
runtime hands in, then ``compile`` (neuronx-cc; NxD's default flags plus nxdc's). The cache entry
holds the NEFF, the HLO and metaneff protobuf bytes, and a JSON file with what ``NxDModel.add``
needs besides (flattener / packer layouts, argument names and shapes), read back the way
``NxDModel.load`` rebuilds them: nothing is pickled.

Run: every bucket of the export is added to ONE ``NxDModel(world_size=tp)`` in one process, so all
buckets share its device-resident KV state; every rank's weights go in through
``set_weights([rank0, ..., rank tp-1])`` (nxdc's per-rank weight files), and each call returns
rank 0's logits to the host, where nxdc samples."""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
import json
import os
import shlex
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch import nn

from nxdc.buckets import Bucket
from nxdc.cache.keys import source_digest
from nxdc.compile.backends.base import Graph, GraphState
from nxdc.compile.trace import graph_for, input_specs
from nxdc.errors import UnsupportedError, UserInputError
from nxdc.model.decoder import GRAPH_PREFIX, kv_cache_names, runtime_constants
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
# a cache entry's files: the NEFF, the traced HLO and metaneff (protobuf bytes), the rest (JSON)
NEFF, HLO, METANEFF, TRACE = "graph.neff", "graph.hlo.pb", "metaneff.pb", "trace.json"
TRACE_FORMAT = 1
# The one forward signature of every bucket (NxDModel.add asserts that all added models share
# their parameter names, and routes inputs by them): a bucket's own inputs (compile/trace.py
# ``input_specs``) by name, every other one a 1-element dummy. int32, as NxD and NxDI feed ids.
ARGS = ("input_ids", "last_index", "positions", "rows", "start")
ARG_DTYPE = torch.int32
# NxD's own defaults (trace/functions.py, append_default_compiler_flags), used only if a
# neuronx-distributed lacks that function; nxdc reads them from the installed NxD otherwise.
NXD_DEFAULT_FLAGS = "--enable-saturate-infinity --auto-cast=none --model-type=transformer -O1"


def missing_packages() -> list[str]:
    return [pip for mod, pip in MODULES.items() if importlib.util.find_spec(mod) is None]


def installed_versions() -> dict[str, str]:
    """The installed Neuron packages' versions, from their distribution metadata (NxD's
    ``__init__.py`` defines no ``__version__``)."""
    out = {}
    for pip in MODULES.values():
        try:
            out[pip] = importlib.metadata.version(pip)
        except importlib.metadata.PackageNotFoundError:
            raise UnsupportedError(
                f"the neuron backend cannot read the installed version of {pip} (no package "
                f"metadata): reinstall the Neuron SDK 2.31: {INSTALL}"
            ) from None
    return out


def logical_cores(target: str) -> int:
    """Logical NeuronCore size: 2 on trn2 (its default), 1 on trn1 / inf2."""
    return 2 if target == "trn2" else 1


def compiler_flags(target: str) -> list[str]:
    """neuronx-cc flags: NxD's defaults (passing any flags to ``compile`` replaces them), then
    the target and its logical-core size (``--lnc``, as NxDI's ModelWrapper passes), then
    ``NXDC_NEURON_CC_FLAGS``. The whole list is a cache-key part."""
    try:
        from neuronx_distributed.trace.functions import append_default_compiler_flags

        defaults = append_default_compiler_flags("")  # "" -> NxD's default string
    except ImportError:
        defaults = NXD_DEFAULT_FLAGS
    extra = os.environ.get("NXDC_NEURON_CC_FLAGS", "")
    return [*shlex.split(defaults), "--target", target, f"--lnc={logical_cores(target)}", *shlex.split(extra)]


class NeuronBucket(nn.Module):
    """A bucket's graph behind the one forward signature (``ARGS``) every neuron bucket has. It
    holds the decoder as ``.model`` (not the wrapped graph, which would prefix every name), so its
    weights and states are named as the runtime's graph constants (``GRAPH_PREFIX``)."""

    def __init__(self, graph: nn.Module, names: list[str]):
        super().__init__()
        self.model = graph.model
        object.__setattr__(self, "graph", graph)  # not a submodule: see above
        self.names = names  # the bucket's own inputs, in its graph's order

    def forward(
        self,
        input_ids: torch.Tensor,
        last_index: torch.Tensor,
        positions: torch.Tensor,
        rows: torch.Tensor,
        start: torch.Tensor,
    ) -> torch.Tensor:
        given = {"input_ids": input_ids, "last_index": last_index, "positions": positions}
        given.update(rows=rows, start=start)
        return self.graph(*[given[n].to(torch.int64) for n in self.names])


def bucket_args(bucket: Bucket, batch: int, speculation: int = 0) -> dict[str, tuple[int, ...]]:
    """Every ``ARGS`` input's shape for ``bucket``: its own inputs' shapes, ``(1,)`` for the rest."""
    own = dict(input_specs(bucket, batch, speculation))
    return {n: tuple(own.get(n, (1,))) for n in ARGS}


def prepare_decoder(model: nn.Module) -> None:
    """Before tracing: the decoder was built on meta and ``to_empty``'d, so its buffers hold
    uninitialised memory. The non-persistent ones (rope tables, ``tp_rank``) get the values the
    runtime hands in (``runtime_constants``, rank 0) and become weights (non-trainable
    parameters, as NxD's own ``SPMDRank`` holds a rank), so ``set_weights`` supplies them per rank
    and a tracer that folds unmutated buffers into constants finds none; the KV caches are
    zeroed (they are device state, zeros at ``to_neuron``). Idempotent: buckets share the model."""
    consts = runtime_constants(model.spec, model.max_seq, 0, model.tp, "cpu")
    for name, t in consts.items():
        if name in model._buffers:
            del model._buffers[name]
            model._non_persistent_buffers_set.discard(name)
        model.register_parameter(name, nn.Parameter(t.clone(), requires_grad=False))
    for name in kv_cache_names(model.spec):
        model.get_buffer(name).zero_()
    left = [n for n, b in model.named_buffers() if n not in set(kv_cache_names(model.spec))]
    if left:  # a new buffer in model/: give it a value here and to the runtime (runtime_constants)
        raise RuntimeError(f"neuron: decoder buffers without a runtime value: {', '.join(left)}")


def provided_names(model: nn.Module) -> tuple[set[str], set[str], set[str]]:
    """(weights, states, runtime constants) as graph constant names that the runtime hands in:
    every tensor of the rank's weight file plus the runtime constants (``set_weights``), and the
    KV caches (device state)."""
    kv = {GRAPH_PREFIX + n for n in kv_cache_names(model.spec)}
    consts = {GRAPH_PREFIX + n for n in runtime_constants(model.spec, 1, 0, model.tp, "meta")}
    weights = ({GRAPH_PREFIX + n for n in model.state_dict()} - kv) | consts
    return weights, kv, consts


def traced_states(metaneff) -> list[str]:
    """The metaneff's state inputs by checkpoint key, as ``NxDModel.add`` reads them."""
    from torch_neuronx.proto import metaneff_pb2

    state = metaneff_pb2.MetaTensor.Type.INPUT_STATE
    return [_text(t.checkpoint_key) for t in metaneff.input_tensors if t.type == state]


def _text(key) -> str:
    return key.decode() if isinstance(key, bytes) else str(key)


def check_traced(name: str, traced, weights: set[str], states: set[str], consts: set[str]) -> None:
    """Before compiling: every traced weight is one the runtime's ``set_weights`` supplies, every
    traced state a KV cache, and every runtime constant (rope tables, ``tp_rank``) a weight, not
    folded into the graph (a folded ``tp_rank`` would make every rank rank 0)."""
    got_w, got_s = set(traced.weight_name_to_idx), set(traced_states(traced.metaneff))
    bad = sorted(got_w - weights) + sorted(got_s - states)
    if bad:
        raise RuntimeError(
            f"neuron bucket {name}: traced inputs the runtime does not provide: {', '.join(bad[:4])}"
        )
    folded = sorted(consts - got_w)
    if folded:
        raise RuntimeError(f"neuron bucket {name}: not traced as weights: {', '.join(folded)}")


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
        self.device = device  # the compile target (neuronx-cc --target), not a torch device

    def compiler_flags(self) -> list[str]:
        return compiler_flags(self.device)

    def key_parts(self, kind: str | None = None) -> dict[str, Any]:
        v = installed_versions()
        return {
            "backend": self.name,
            "device": self.device,
            "torch": torch.__version__,
            "isa": f"neuronx-cc-{v['neuronx-cc']}-nxd-{v['neuronx-distributed']}",
            "versions": v,
            "flags": self.compiler_flags(),
            "backend_code": source_digest(Path(__file__).resolve()),
        }

    def build(self, model, bucket: Bucket, plan: ExportPlan, out_dir: Path) -> None:
        from neuronx_distributed import NxDParallelState
        from neuronx_distributed.trace.functions import compile as nxd_compile
        from neuronx_distributed.trace.functions import trace as nxd_trace

        prepare_decoder(model)
        weights, states, consts = provided_names(model)
        names = [n for n, _ in input_specs(bucket, plan.batch_size, plan.speculation_length)]
        wrapper = NeuronBucket(graph_for(model, bucket, plan.speculation_length, return_kv=False), names)
        shapes = bucket_args(bucket, plan.batch_size, plan.speculation_length)
        args = tuple(torch.zeros(shapes[n], dtype=ARG_DTYPE) for n in ARGS)
        flags = self.compiler_flags()
        lnc = logical_cores(self.device)
        kv = {n: model.get_buffer(n) for n in kv_cache_names(model.spec)}
        try:
            with (
                NxDParallelState(world_size=plan.tp, tensor_model_parallel_size=plan.tp, lnc_size=lnc),
                xla_collectives(),
                torch.no_grad(),
                tempfile.TemporaryDirectory(dir=out_dir.parent) as work,
            ):
                traced = nxd_trace(wrapper, args=args, spmd=True, preserve_parameters=True)
                check_traced(bucket.name, traced, weights, states, consts)  # before the compiler runs
                compiled = nxd_compile(
                    traced.hlo,
                    traced.metaneff,
                    compiler_workdir=work,
                    compiler_args=" ".join(shlex.quote(f) for f in flags),
                    key=bucket.name,
                )
                shutil.copyfile(compiled.neff_filepath, out_dir / NEFF)
        finally:  # the traced graph re-assigned the caches: the next bucket traces the originals
            for n, t in kv.items():
                owner, _, attr = n.rpartition(".")
                setattr(model.get_submodule(owner), attr, t)
        save_trace(traced, out_dir, {"flags": flags, "target": self.device, "tp": plan.tp, "lnc": lnc})

    def export_path(self, bucket: str, file: str) -> str:
        return f"artifacts/{bucket}/{file}"

    def place(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return tensors  # host tensors: NxDModel.set_weights moves them to the device

    def load(self, name: str, files: dict[str, Path], state: GraphState, inputs) -> Graph:
        return NeuronGraph(name, files, state, inputs)


def save_trace(traced, out_dir: Path, meta: dict[str, Any]) -> None:
    """``TraceArtifacts`` as files, never pickled (it holds torch-neuronx's flattener, packer and
    protobufs): the HLO and metaneff as protobuf bytes, the rest as JSON; the flattener and packer
    as the strings ``NxDModel.save`` keeps of them (TorchScriptNxDModel) and ``NxDModel.load``
    parses back with ``ast.literal_eval``."""
    (out_dir / HLO).write_bytes(traced.hlo.SerializeToString())
    (out_dir / METANEFF).write_bytes(traced.metaneff.SerializeToString())
    f, p = traced.flattener, traced.packer
    doc = {
        "format": TRACE_FORMAT,
        "flattener": {"layout": str(f.layout), "exclude": str(f.exclude)},
        "packer": {"layout": str(p.layout), "identifiers": str(p.identifiers), "constants": str(p.constants)},
        "provided_args": [
            {
                "name": a.param_name,
                "is_positional": a.is_positional,
                "shape": list(a.tensor.shape),
                "dtype": str(a.tensor.dtype).removeprefix("torch."),
            }
            for a in traced.provided_args
        ],
        "model_params": [
            {"name": m.param_name, "is_positional": m.is_positional} for m in traced.model_params
        ],
        "weight_name_to_idx": dict(traced.weight_name_to_idx),
        "weight_names_to_skip": sorted(traced.weight_names_to_skip or ()),
        "states": traced_states(traced.metaneff),
        **meta,
    }
    (out_dir / TRACE).write_text(json.dumps(doc, indent=1))


def load_trace(files: dict[str, Path]):
    """A cache entry's ``TraceArtifacts``, rebuilt as ``NxDModel.load`` rebuilds a saved model's
    flatteners and packers (trace/nxd_model/nxd_model.py), and its JSON."""
    from neuronx_distributed.trace.model_builder_utils import ModelParamInfo, ProvidedArgInfo, TraceArtifacts
    from torch_neuronx.proto import metaneff_pb2
    from torch_neuronx.pyhlo import hlo_pb2
    from torch_neuronx.xla_impl import structure

    doc = json.loads(files[TRACE].read_text())
    if doc.get("format") != TRACE_FORMAT:
        raise RuntimeError(
            f"{files[TRACE].name} is in format {doc.get('format')}, this nxdc reads {TRACE_FORMAT}"
        )
    hlo = hlo_pb2.HloModuleProto()
    hlo.ParseFromString(files[HLO].read_bytes())
    metaneff = metaneff_pb2.MetaNeff()
    metaneff.ParseFromString(files[METANEFF].read_bytes())
    f, p = doc["flattener"], doc["packer"]
    flattener = structure.Flattener(ast.literal_eval(f["layout"]), ast.literal_eval(f["exclude"]))
    packer = structure.Packer(
        ast.literal_eval(p["layout"]), ast.literal_eval(p["identifiers"]), ast.literal_eval(p["constants"])
    )
    provided = [
        ProvidedArgInfo(
            a["name"], a["is_positional"], torch.zeros(a["shape"], dtype=getattr(torch, a["dtype"]))
        )
        for a in doc["provided_args"]
    ]
    params = [ModelParamInfo(m["name"], m["is_positional"]) for m in doc["model_params"]]
    traced = TraceArtifacts(
        hlo=hlo,
        metaneff=metaneff,
        flattener=flattener,
        packer=packer,
        weight_name_to_idx=doc["weight_name_to_idx"],
        weight_names_to_skip=set(doc["weight_names_to_skip"]),
        provided_args=provided,
        model_params=params,
    )
    return traced, doc


class NeuronModel:
    """The export's one ``NxDModel`` (per process): every bucket added, then loaded on the first
    call with every rank's weights."""

    def __init__(self, state: GraphState):
        from neuronx_distributed import NxDModel

        self.state = state
        self.ranks: list[dict[str, torch.Tensor]] = state.extra.get("ranks", [state.tensors])
        if len(self.ranks) != state.tp:
            raise RuntimeError(f"neuron: {len(self.ranks)} ranks' weights loaded for a tp {state.tp} export")
        self.model = NxDModel(world_size=state.tp)
        self.weights: set[str] = set()
        self.loaded = False

    def add(self, name: str, traced, neff: Path) -> None:
        from neuronx_distributed.trace.model_builder_utils import CompilationArtifacts

        self.model.add(name, traced, CompilationArtifacts(os.fspath(neff)))
        self.weights |= set(traced.weight_name_to_idx)

    def ensure_loaded(self) -> None:
        if self.loaded:  # every bucket is added by the first call
            return
        self.model.set_weights(
            [{n: rank[n].contiguous() for n in sorted(self.weights)} for rank in self.ranks]
        )
        self.model.to_neuron()  # the KV states start as zeros on the device
        self.loaded = True


class NeuronGraph(Graph):
    """One bucket of the export's single NxDModel, called by ``model_name`` (buckets of equal
    input shapes, e.g. decode over 256 and 512 cache slots, are routed by it)."""

    def __init__(self, name: str, files: dict[str, Path], state: GraphState, inputs):
        super().__init__(name, inputs, "cpu")
        traced, doc = load_trace(files)
        kv = set(state.kv)
        missing = sorted(set(traced.weight_name_to_idx) - (set(state.tensors) - kv))
        missing += sorted(set(doc["states"]) - kv)
        if missing:
            raise RuntimeError(f"graph {name} needs tensors the export lacks: {', '.join(missing[:4])}")
        self._runtime = state.extra.get("neuron")
        if self._runtime is None:
            self._runtime = state.extra["neuron"] = NeuronModel(state)
        self._runtime.add(name, traced, files[NEFF])
        self._shapes = {a["name"]: tuple(a["shape"]) for a in doc["provided_args"]}
        self._names = [n for n, _ in inputs]

    def __call__(self, *arrays: torch.Tensor) -> torch.Tensor:
        self.check(arrays)
        self._runtime.ensure_loaded()
        given = dict(zip(self._names, arrays, strict=True))
        args = [
            (given[n] if n in given else torch.zeros(self._shapes[n])).to(ARG_DTYPE).contiguous()
            for n in ARGS
        ]
        out = self._runtime.model(*args, model_name=self.name)
        return (out[0] if isinstance(out, (tuple, list)) else out).cpu()


def doctor() -> list[tuple[str, bool, str]]:
    """``nxdc doctor``'s lines for this backend."""
    missing = missing_packages()
    if missing:
        return [("backend neuron", False, f"missing {', '.join(missing)}: {INSTALL}")]
    versions = ", ".join(f"{p} {v}" for p, v in installed_versions().items())
    return [
        (
            "backend neuron",
            True,
            f"Neuron SDK found ({versions}); export with --device {' | '.join(TARGETS)} "
            "(this backend has never run: docs/neuron.md)",
        )
    ]


create = NeuronBackend  # the registry's entry point: create(device) -> Backend
