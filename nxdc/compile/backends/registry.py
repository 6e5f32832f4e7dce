"""The compile backends nxdc knows, one entry each: what the rest of nxdc (planning, the CLI's
help, ``nxdc doctor``, the exporter, the runtime) knows about a backend, and the module that holds
its code. Nothing else names a backend.

An entry is data; the backend's module supplies the behaviour, by name:
``create(device) -> Backend`` (raises a one-line error where it cannot run here),
``validate(options)`` (optional: plan-time checks beyond the KV-update mode, raising one-line
errors) and ``doctor() -> [(check, usable, detail)]``. The module is imported only when one of
those is needed, so this registry (and the CLI's help, which reads it) costs no torch import."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from nxdc.errors import UserInputError


@dataclass(frozen=True)
class BackendRules:
    name: str
    module: str  # the backend's code: create(), validate(), doctor() and its Backend class
    summary: str  # one phrase for --backend's help
    devices: str  # what --device takes under this backend, e.g. "cpu | cuda[:N]" (help text)
    kv_updates: tuple[str, ...]  # how its graphs may write the KV cache; the first is its default
    in_process_tp: bool = False  # one process drives every rank (neuron: one NxDModel(world_size))
    device_is_target: bool = False  # --device names a compile target: tensors stay on the CPU
    cpu_kernels: bool = False  # its graphs on the CPU may call nxdc's CPU kernels

    def code(self) -> ModuleType:
        return importlib.import_module(self.module)

    def create(self, device: str):
        return self.code().create(device)

    def validate(self, opts: Any) -> None:
        check = getattr(self.code(), "validate", None)
        if check is not None:
            check(opts)

    def doctor(self) -> list[tuple[str, bool, str]]:
        return self.code().doctor()


PACKAGE = "nxdc.compile.backends"
BACKENDS: dict[str, BackendRules] = {
    r.name: r
    for r in (
        BackendRules(
            "inductor", f"{PACKAGE}.inductor", "torch.export + AOTInductor, the default", "cpu | cuda[:N]",
            ("in-place", "functional"), cpu_kernels=True,
        ),
        BackendRules(
            "xla", f"{PACKAGE}.xla", "torch-xla StableHLO on XLA:CPU, tp 1, in .venv-xla", "cpu",
            ("functional",),
        ),
        BackendRules(
            "neuron", f"{PACKAGE}.neuron", "AWS Neuron SDK, NxD trace to NEFF", "trn1 | trn2 | inf2",
            ("functional",), in_process_tp=True, device_is_target=True,
        ),
    )
}  # fmt: skip
DEFAULT = "inductor"


def rules(name: str) -> BackendRules:
    if name not in BACKENDS:
        raise UserInputError(f"--backend must be one of {', '.join(BACKENDS)} (got {name!r})")
    return BACKENDS[name]


def get_backend(name: str, device: str = "cpu"):
    """The backend ``name`` for ``device``; raises a one-line error where it cannot run here."""
    return rules(name).create(device)


def check_options(opts: Any) -> str:
    """A plan's backend rules, checked on its ``ExportOptions``: the backend exists, its KV-update
    mode is one it allows, and its own checks pass. Returns the KV-update mode (the backend's
    default where none was asked for)."""
    r = rules(opts.backend)
    mode = opts.kv_update or r.kv_updates[0]
    if mode not in r.kv_updates:
        raise UserInputError(
            f"--kv-update {mode}: the {r.name} backend writes the KV cache {' or '.join(r.kv_updates)}"
        )
    r.validate(opts)
    return mode


def host_device(plan: Any) -> str:
    """The torch device a plan's decoder is traced on and its weights loaded on: its ``--device``,
    except where that names a compile target (neuron: trn1 | trn2 | inf2), whose tensors stay on
    the CPU until the backend's runtime moves them."""
    return "cpu" if rules(plan.backend).device_is_target else plan.device


def help_text() -> dict[str, str]:
    """The help of --backend, --device and --kv-update, from the entries."""
    each = BACKENDS.values()
    modes = sorted({m for r in each for m in r.kv_updates})
    backends = "; ".join(f"{r.name}: {r.summary}" for r in each)
    devices = "; ".join(f"{r.devices} ({r.name})" for r in each)
    kv = "; ".join(r.name + ": " + " or ".join(r.kv_updates) for r in each)
    return {
        "backend": f"{' | '.join(BACKENDS)} ({backends}; docs/backends.md).",
        "device": f"Where the graphs run: {devices}.",
        "kv_update": f"How graphs write the KV cache: {' | '.join(modes)} ({kv}).",
    }


def doctor_lines() -> list[tuple[str, bool, str]]:
    return [line for r in BACKENDS.values() for line in r.doctor()]
