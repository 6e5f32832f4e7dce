"""torch.export + AOTInductor packages, with weights kept out of the compiled code.

Packages are built with ``package_constants_in_so=False``: weights and KV caches are
user-managed constants handed in at load time, shared by every bucket graph.

Safety rules the loader enforces, because AOTInductor does not:
- a graph is callable only after all of its constants were loaded (calling it earlier
  segfaults): ``CompiledGraph`` is created with its constants or not at all;
- inputs must have exactly the traced shape, dtype and strides: every call copies into
  preallocated contiguous input tensors after checking the shape."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from nxdc.buckets import Bucket
from nxdc.cache.keys import source_digest
from nxdc.compile.backends.base import Graph, GraphState
from nxdc.compile.trace import fake_process_group, trace
from nxdc.errors import ExportDirError, UnsupportedError, UserInputError
from nxdc.kernels import compiler, cpu_isa
from nxdc.plan import ExportPlan

ARTIFACT = "model.pt2"


def extra_configs() -> dict[str, Any]:
    """``NXDC_INDUCTOR_CONFIG``: a JSON object of further Inductor settings, e.g.
    ``{"max_autotune": true}``, applied to every graph; like every flag, part of the cache key."""
    raw = os.environ.get("NXDC_INDUCTOR_CONFIG")
    if not raw:
        return {}
    try:
        extra = json.loads(raw)
    except ValueError as e:
        raise UserInputError(f"NXDC_INDUCTOR_CONFIG is not valid JSON: {e}") from e
    if not isinstance(extra, dict):
        raise UserInputError("NXDC_INDUCTOR_CONFIG must be a JSON object of Inductor settings")
    from torch._inductor import config

    unknown = sorted(set(extra) - set(config.get_config_copy()))
    if unknown:
        raise UserInputError(
            f"NXDC_INDUCTOR_CONFIG: torch {torch.__version__} has no Inductor setting {unknown[0]!r}"
        )
    return extra


def check_device(device: str) -> str:
    if device == "cpu":
        return device
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise UnsupportedError(f"--device {device}: no CUDA device is available on this machine")
        return device
    raise UserInputError(f"--device must be cpu or cuda[:N] (got {device!r})")


class InductorBackend:
    name = "inductor"
    artifact = ARTIFACT  # the file a cache entry holds

    def __init__(self, device: str = "cpu"):
        self.device = check_device(device)
        extra_configs()  # a bad NXDC_INDUCTOR_CONFIG fails here, before any work

    def inductor_configs(self, kind: str | None = None) -> dict[str, Any]:
        """Inductor settings for a graph of bucket ``kind`` (context / decode / verify).

        always_keep_tensor_constants: Inductor otherwise folds small constants into the code,
        and some are bound per rank at load time (the tensor-parallel rank index).
        cpp.threads = 1 for CPU decode / verify graphs: their generated code (norms, RoPE, SiLU,
        cache writes on a few rows) is microseconds of work, less than an OpenMP fork/join, so
        it runs on the calling thread; nxdc's kernels in the same graph still use every thread."""
        flags: dict[str, Any] = {
            "aot_inductor.package_constants_in_so": False,
            "always_keep_tensor_constants": True,
        }
        if self.device == "cpu" and kind in ("decode", "verify"):
            flags["cpp.threads"] = 1
        flags.update(extra_configs())
        return flags

    def key_parts(self, kind: str | None = None) -> dict[str, Any]:
        return {
            "backend": self.name,
            "device": self.device.split(":")[0],
            "torch": torch.__version__,
            "isa": cpu_isa() if self.device == "cpu" else torch.cuda.get_device_capability(self.device),
            "flags": self.inductor_configs(kind),
            "backend_code": source_digest(Path(__file__).resolve()),
        }

    def build(self, model, bucket: Bucket, plan: ExportPlan, out_dir: Path) -> None:
        with fake_process_group(plan.tp):  # the graphs' collectives name a tp-rank group
            ep = trace(model, bucket, plan.batch_size, plan.device, plan.speculation_length)
            self.compile(ep, out_dir, bucket.kind)

    def compile(self, ep: torch.export.ExportedProgram, out_dir: Path, kind: str | None = None) -> None:
        from torch._inductor import aoti_compile_and_package

        out = os.fspath(out_dir / ARTIFACT)
        aoti_compile_and_package(ep, package_path=out, inductor_configs=self.inductor_configs(kind))

    def export_path(self, bucket: str, file: str) -> str:
        return f"artifacts/{bucket}.pt2"  # one file per bucket

    def place(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return tensors  # loaded on the plan's device already

    def load(self, name: str, files: dict[str, Path], state: GraphState, inputs) -> Graph:
        from torch._inductor import aoti_load_package

        return CompiledGraph(name, aoti_load_package(os.fspath(files[ARTIFACT])), state, inputs, self.device)


class CompiledGraph(Graph):
    def __init__(self, name: str, loaded, state: GraphState, inputs, device: str):
        super().__init__(name, inputs, device)
        constants = state.tensors
        fqns = loaded.get_constant_fqns()
        missing = sorted(set(fqns) - set(constants))
        if missing:
            raise ExportDirError(f"graph {name} needs constants the export lacks: {', '.join(missing[:4])}")
        loaded.load_constants({f: constants[f] for f in fqns}, check_full_update=True, user_managed=True)
        self._runner = loaded.loader
        # functional KV writes (--kv-update functional): the graph returns new caches, copied
        # back into the buffers every graph was handed as constants
        self._kv = [constants[n] for n in state.kv] if state.kv_update == "functional" else None
        # generation (sampling, speculation, stopping) works on host tensors: an accelerator's
        # logits come back to the CPU once per call (at batch 8, 1.5 MB for a 49k vocabulary)
        self._host = torch.device(device).type != "cpu"

    def __call__(self, *arrays: torch.Tensor) -> torch.Tensor:
        self.check(arrays)
        for buf, a in zip(self._inputs, arrays, strict=True):
            buf.copy_(a)
        outs = self._runner.boxed_run(list(self._inputs))
        if self._kv is not None:
            for buf, new in zip(self._kv, outs[1:], strict=True):
                buf.copy_(new)
        out = outs[0]
        return out.cpu() if self._host else out


def doctor() -> list[tuple[str, bool, str]]:
    """``nxdc doctor``'s lines for this backend."""
    cxx = compiler()
    lines = [
        (
            "backend inductor/cpu",
            cxx is not None,
            f"torch.export + AOTInductor (the default), compiles with {cxx[0]}"
            if cxx
            else "no C++ compiler: exports only from a cache remote that holds every graph "
            "(--require-cache); generate and serve run exports as they are",
        )
    ]
    if torch.cuda.is_available():
        names = ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))
        lines.append(("backend inductor/cuda", True, f"CUDA {torch.version.cuda}: {names}"))
    else:
        why = "torch is a CPU build" if torch.version.cuda is None else f"torch has CUDA {torch.version.cuda}"
        lines.append(("backend inductor/cuda", False, f"no CUDA device ({why})"))
    return lines


create = InductorBackend  # the registry's entry point: create(device) -> Backend
