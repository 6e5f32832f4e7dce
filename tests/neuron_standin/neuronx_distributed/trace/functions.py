"""CONTRACT STAND-IN for trace/functions.py: ``trace``, ``compile`` and
``append_default_compiler_flags`` with the checks and defaults of NxD 0.18's source.

``trace`` validates the model and inputs as NxD's ``_process_example_inputs`` does (explicit
parameters only, defaults None, tensors), requires CPU tensors (torch-neuronx traces from the
host; a meta or foreign-device tensor fails there), and then plays the tracer's worst case for
state: a buffer re-assigned in forward becomes aliased state (INPUT_STATE), parameters and
persistent buffers become weights (INPUT_WEIGHT, ``weight_name_to_idx``), and an unmutated
non-persistent buffer is folded into the graph as a constant with the value it had at trace
time. The "HLO" is a torch.export program of the model in functional form."""

from __future__ import annotations

import inspect
import io
import os
import re

import torch
from torch_neuronx._standin_device import LOG, NEFF_MAGIC
from torch_neuronx.proto import metaneff_pb2
from torch_neuronx.pyhlo import hlo_pb2
from torch_neuronx.xla_impl.structure import Flattener, Packer

from neuronx_distributed.trace import parallel_context
from neuronx_distributed.trace.model_builder_utils import (
    CompilationArtifacts,
    ModelParamInfo,
    ProvidedArgInfo,
    TraceArtifacts,
)

TARGETS = ("trn1", "trn2", "inf2")
_STATES: list[str] = []  # the buffers the last traced forward re-assigned


def append_default_compiler_flags(compiler_args=""):
    """As NxD's: no flags -> NxD's defaults; any flags replace them, then --auto-cast, an -O
    level and --verbose are added where missing."""
    if not compiler_args:
        compiler_args = "--enable-saturate-infinity --auto-cast=none --model-type=transformer -O1"
    if "--auto-cast" not in compiler_args:
        compiler_args += " --auto-cast=none "
    if not re.search(r"-O\d+", compiler_args):
        compiler_args += " -O1 "
    if "--verbose" not in compiler_args:
        compiler_args += " --verbose=35"
    return compiler_args


def _model_params(model) -> list[ModelParamInfo]:
    sig = inspect.signature(model.forward if isinstance(model, torch.nn.Module) else model)
    if not sig.parameters:
        raise ValueError("Model must have at least one parameter")
    out = []
    for name, p in sig.parameters.items():
        if p.kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD):
            raise NotImplementedError("Methods with *args or **kwargs are not supported.")
        if name == "self":
            continue
        positional = p.default is inspect.Parameter.empty
        if not positional and p.default is not None:
            raise ValueError(f"Parameter '{name}' has a non-None default value")
        out.append(ModelParamInfo(name, positional))
    return out


class _Functional(torch.nn.Module):
    """``model`` (same parameters and buffers, same names) returning ``(outputs, *re-assigned
    buffers)`` and leaving its buffers as they were: the aliasing the real tracer does."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self._modules, self._parameters, self._buffers = model._modules, model._parameters, model._buffers
        self._non_persistent_buffers_set = model._non_persistent_buffers_set
        object.__setattr__(self, "_inner", model)

    def forward(self, *args):
        before = dict(self.named_buffers())
        versions = {n: b._version for n, b in before.items()}
        out = self._inner(*args)
        after = dict(self.named_buffers())
        # re-assigned (or, as torch.export may record a re-assignment, written in place)
        # (module level: torch.export restores or copies what a forward sets on the module)
        _STATES[:] = [n for n in before if after[n] is not before[n] or after[n]._version != versions[n]]
        new = [after[n] for n in _STATES]
        for n in _STATES:
            owner, _, attr = n.rpartition(".")
            setattr(self.get_submodule(owner) if owner else self, attr, before[n])
        return (out, *new)


def _non_persistent(model: torch.nn.Module) -> set[str]:
    out = set()
    for prefix, m in model.named_modules():
        out |= {f"{prefix}.{n}" if prefix else n for n in m._non_persistent_buffers_set}
    return out


def trace(
    model,
    args=None,
    kwargs=None,
    spmd=True,
    preserve_parameters=True,
    weights_to_skip_layout_optimization=None,
):
    if not spmd:
        raise NotImplementedError("MPMD tracing is not currently supported")
    params = _model_params(model)
    if isinstance(args, torch.Tensor):
        args = (args,)
    args = tuple(args or ())
    if not all(isinstance(a, torch.Tensor) for a in args) or len(args) > len(params):
        raise ValueError("args must be a tuple of at most one tensor per model parameter")
    if kwargs:
        raise NotImplementedError("stand-in: nxdc passes every input positionally")
    missing = [p.param_name for p in params[len(args) :] if p.is_positional]
    if missing:
        raise ValueError(f"Missing required parameters: {missing}")
    provided = [ProvidedArgInfo(p.param_name, p.is_positional, t) for p, t in zip(params, args, strict=False)]
    state = parallel_context.current()
    if state is None:
        raise RuntimeError(
            "stand-in trace: NxD traces under NxDParallelState (parallel state not initialized)"
        )
    tensors = dict(model.named_parameters(remove_duplicate=False)) | dict(
        model.named_buffers(remove_duplicate=False)
    )
    off = sorted(n for n, t in tensors.items() if t.device.type != "cpu")
    off += [f"input {a.param_name}" for a in provided if a.tensor.device.type != "cpu"]
    if off:
        raise ValueError(
            f"stand-in trace: tensors not on the CPU ({', '.join(off[:3])}): NxD traces from host tensors"
        )

    seen = {n: t.detach().clone() for n, t in tensors.items()}  # what the tracer saw
    functional = _Functional(model)
    _STATES.clear()
    with torch.no_grad():
        ep = torch.export.export(functional, args, strict=False)
    states = list(_STATES)
    non_persistent = _non_persistent(model)
    folded = sorted(n for n in dict(model.named_buffers()) if n in non_persistent and n not in states)
    weights = [n for n in dict(model.state_dict(keep_vars=True)) if n not in states and n not in folded]
    for n in folded:  # baked in with its trace-time value: the runtime never supplies it
        ep.constants[n] = seen[n]

    # inputs the graph never reads (the flattener's ``exclude``)
    user_nodes = {s.arg.name: s for s in ep.graph_signature.input_specs if s.kind.name == "USER_INPUT"}
    placeholders = {n.name: n for n in ep.graph.nodes if n.op == "placeholder"}
    exclude = [i for i, name in enumerate(user_nodes) if not placeholders[name].users]

    buf = io.BytesIO()
    torch.export.save(ep, buf)
    meta = metaneff_pb2.MetaNeff()
    T = metaneff_pb2.MetaTensor
    for i, a in enumerate(provided):
        m = T(str(i), T.Type.USER_INPUT, a.tensor.shape, str(a.tensor.dtype).removeprefix("torch."))
        m.user_input_key = a.param_name.encode()
        (meta.excluded_inputs if i in exclude else meta.input_tensors).append(m)
    entries = {}
    for kind, names in ((T.Type.INPUT_WEIGHT, weights), (T.Type.INPUT_STATE, states)):
        for n in names:
            t = tensors[n]
            entries[n] = len(meta.input_tensors)
            dtype = str(t.dtype).removeprefix("torch.")
            meta.input_tensors.append(T(n, kind, t.shape, dtype, checkpoint_key=n.encode()))
    meta.output_tensors.append(T("out", T.Type.OUTPUT, (), "float32"))
    for j, n in enumerate(states):
        meta.output_tensors.append(
            T(n, T.Type.OUTPUT, tensors[n].shape, str(tensors[n].dtype).removeprefix("torch."))
        )
        meta.output_aliases_to[1 + j] = entries[n]
    meta.serialized_graph_def = buf.getvalue()
    meta.folded = folded
    LOG["trace"].append(
        {
            "parallel_state": dict(state),
            "params": [p.param_name for p in params],
            "args": {a.param_name: (tuple(a.tensor.shape), a.tensor.dtype) for a in provided},
            "weights": weights,
            "states": states,
            "folded": folded,
            "seen": seen,
        }
    )
    return TraceArtifacts(
        hlo=hlo_pb2.HloModuleProto(buf.getvalue()),
        metaneff=meta,
        flattener=Flattener(tuple(range(len(provided))), exclude or None),
        packer=Packer(0, None, None),
        weight_name_to_idx={n: i for i, n in enumerate(weights)},
        weight_names_to_skip=set(weights_to_skip_layout_optimization or ()),
        provided_args=provided,
        model_params=params,
    )


def compile(hlo_module, metaneff, compiler_workdir=None, compiler_args=None, key=None):  # noqa: A001
    if not hlo_module or not metaneff:
        raise ValueError("Required compile arguments missing")
    if compiler_args is not None and not isinstance(compiler_args, str):
        raise TypeError("stand-in compile: compiler_args is a string (NxD appends to it)")
    final = append_default_compiler_flags(compiler_args)
    target = re.search(r"--target[= ](\S+)", final)
    if target is None or target.group(1) not in TARGETS:
        raise RuntimeError(f"stand-in compile: no --target trn1|trn2|inf2 (off a Neuron instance): {final}")
    workdir = os.path.join(compiler_workdir or "/tmp/nxd_models", key or "model")
    os.makedirs(workdir, exist_ok=True)
    neff = os.path.join(workdir, "graph.neff")
    with open(neff, "wb") as f:
        f.write(NEFF_MAGIC + metaneff.serialized_graph_def)
    LOG["compile"].append(
        {
            "key": key,
            "compiler_args": compiler_args,
            "final": final,
            "parallel_state": parallel_context.current(),
        }
    )
    return CompilationArtifacts(neff_filepath=neff)
