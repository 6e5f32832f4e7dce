"""torch-xla: each bucket's graph lowered to StableHLO and run on torch-xla's CPU client.

Build: torch.export traces the bucket (functional KV writes: the graph returns its new caches),
and torch-xla's exporter runs that graph on lazy XLA tensors to get StableHLO, the same
lazy-tensor lowering torch-neuronx traces through. A cache entry holds the program's bytecode,
its signature (where each program input comes from: a user input, a weight or cache by graph
constant name, or a constant the lowering created) and those constants. Weights are never in
the entry: the runtime hands the rank's tensors in, once placed on the XLA device.

Run: the program's new KV caches replace the shared ones (``GraphState.update_kv``); XLA
compiles a program on its first call in a process and reuses it after.

torch-xla is built for one torch release (2.9 here), not nxdc's pinned 2.13: it lives in its
own environment, ``.venv-xla`` (``make test-xla``, docs/backends.md)."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import tempfile
from pathlib import Path
from typing import Any

import torch

from nxdc.buckets import Bucket
from nxdc.cache.keys import source_digest
from nxdc.compile.backends.base import Graph, GraphState
from nxdc.compile.trace import trace
from nxdc.errors import UnsupportedError, UserInputError
from nxdc.plan import ExportPlan

PROGRAM, SIGNATURE = "forward.bytecode", "forward.meta"
INSTALL = (
    "torch-xla is built for one torch release: `make test-xla` creates .venv-xla with torch 2.9.0 "
    "and torch-xla 2.9.0 from PyPI; run .venv-xla/bin/nxdc there (docs/backends.md)"
)


class XlaBackend:
    name = "xla"

    def __init__(self, device: str = "cpu"):
        if importlib.util.find_spec("torch_xla") is None:
            raise UnsupportedError(
                f"the xla backend needs torch-xla, which this environment (torch {torch.__version__}) "
                f"lacks: {INSTALL}"
            )
        if device != "cpu":
            raise UserInputError(f"--backend xla runs on XLA:CPU: use --device cpu (got {device!r})")
        os.environ.setdefault("PJRT_DEVICE", "CPU")
        self.device = "cpu"

    def key_parts(self, kind: str | None = None) -> dict[str, Any]:
        import torch_xla

        return {
            "backend": self.name,
            "device": "cpu",
            "torch": torch.__version__,
            "isa": f"torch_xla-{torch_xla.__version__}",
            "backend_code": source_digest(Path(__file__).resolve()),
        }

    def build(self, model, bucket: Bucket, plan: ExportPlan, out_dir: Path) -> None:
        from torch_xla.stablehlo import StableHLOExportOptions, exported_program_to_stablehlo

        ep = trace(model, bucket, plan.batch_size, "cpu", plan.speculation_length)
        options = StableHLOExportOptions(include_human_readable_text=False, export_weights=False)
        program = exported_program_to_stablehlo(ep, options)
        with tempfile.TemporaryDirectory(dir=out_dir.parent) as tmp:
            program.save(tmp, StableHLOExportOptions(save_weights=False))
            # flat, as a cache entry holds files: functions/forward.* and constants/<i>
            for f in (PROGRAM, SIGNATURE):
                os.replace(Path(tmp) / "functions" / f, out_dir / f)
            for c in (Path(tmp) / "constants").iterdir():
                os.replace(c, out_dir / f"constant-{int(c.name)}.npy")

    def export_path(self, bucket: str, file: str) -> str:
        return f"artifacts/{bucket}/{file}"

    def place(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        import torch_xla

        dev = torch_xla.device()
        return {n: t.to(dev) for n, t in tensors.items()}

    def load(self, name: str, files: dict[str, Path], state: GraphState, inputs) -> Graph:
        return XlaGraph(name, files, state, inputs)


class XlaGraph(Graph):
    def __init__(self, name: str, files: dict[str, Path], state: GraphState, inputs):
        import numpy as np
        import torch_xla
        from torch_xla.stablehlo import (
            StableHLOFunc,
            StableHLOGraphModule,
            StableHLOModelBundle,
            VariableType,
            stablehlo_obj_hook,
        )

        super().__init__(name, inputs, "cpu")
        meta = json.loads(files[SIGNATURE].read_text(), object_hook=stablehlo_obj_hook)
        wanted = [loc.name for loc in meta.input_locations if loc.type_ == VariableType.PARAMETER]
        missing = sorted(set(wanted) - set(state.tensors))
        if missing:
            raise RuntimeError(f"graph {name} needs constants the export lacks: {', '.join(missing[:4])}")
        n_const = sum(1 for f in files if f.startswith("constant-"))
        constants = [np.load(files[f"constant-{i}.npy"]) for i in range(n_const)]
        # the bundle reads the shared state dict at every call: the latest caches, by name
        bundle = StableHLOModelBundle(
            state_dict=state.tensors,
            additional_constants=constants,
            stablehlo_funcs=[StableHLOFunc(meta, files[PROGRAM].read_bytes(), None)],
        )
        self._module = StableHLOGraphModule(bundle)
        self._state = state
        self._device = torch_xla.device()

    def __call__(self, *arrays: torch.Tensor) -> torch.Tensor:
        self.check(arrays)
        outs = self._module(*[a.to(torch.int64).contiguous().to(self._device) for a in arrays])
        self._state.update_kv(outs[1:])
        return outs[0].cpu()


def validate(opts) -> None:
    """Plan-time checks of the ExportOptions (the registry's ``check_options`` calls this)."""
    if opts.tp > 1:
        raise UnsupportedError(
            "--backend xla runs on torch-xla's CPU client, one device: tensor parallelism (--tp "
            f"{opts.tp}) is not supported there; use --tp 1, or --backend inductor for --tp > 1"
        )
    if opts.device != "cpu":
        raise UserInputError(f"--backend xla runs on XLA:CPU: use --device cpu (got {opts.device!r})")


def doctor() -> list[tuple[str, bool, str]]:
    """``nxdc doctor``'s lines for this backend."""
    if importlib.util.find_spec("torch_xla") is None:
        return [("backend xla", False, f"torch-xla not installed (torch {torch.__version__}): {INSTALL}")]
    try:
        version = importlib.metadata.version("torch-xla")
    except importlib.metadata.PackageNotFoundError:
        version = "(version unknown)"
    return [("backend xla", True, f"torch-xla {version}: --backend xla runs on XLA:CPU (tp 1)")]


create = XlaBackend  # the registry's entry point: create(device) -> Backend
