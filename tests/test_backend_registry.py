"""A backend is one file plus its registry entry. This test module is a toy backend's file (its
``create``, ``validate`` and ``doctor``, and a Backend that builds and loads like inductor), and
the test adds its entry to the registry, nothing else; nxdc then plans with its rules, exports
through it, records it in the manifest, loads and runs the export with it, and lists it in
``nxdc doctor`` and in the --backend help."""

from __future__ import annotations

import json

import pytest
import torch
from parity import nxdc_logits
from tiny import GQA_EXPORT
from typer.testing import CliRunner

from nxdc.compile.backends import registry as backend_registry
from nxdc.compile.backends.inductor import InductorBackend
from nxdc.errors import UserInputError

MAX_SLOTS = 64


class ToyBackend(InductorBackend):
    """Inductor's build and load under another name, counting what nxdc asks of it. Its key parts
    are inductor's, so its graphs are the cache entries the inductor export compiled."""

    name = "toy"
    created: list[str] = []
    loaded: list[str] = []

    def __init__(self, device: str = "cpu"):
        super().__init__(device)
        ToyBackend.created.append(device)

    def key_parts(self, kind=None):
        return {**super().key_parts(kind), "backend": "inductor"}

    def load(self, name, files, state, inputs):
        ToyBackend.loaded.append(name)
        return super().load(name, files, state, inputs)


create = ToyBackend  # the three functions a backend's file supplies


def validate(opts) -> None:
    if opts.sequence_length is not None and opts.sequence_length > MAX_SLOTS:
        raise UserInputError(f"--backend toy holds at most {MAX_SLOTS} cache slots")


def doctor() -> list[tuple[str, bool, str]]:
    return [("backend toy", True, "declared by tests/test_backend_registry.py")]


TOY = backend_registry.BackendRules(
    "toy", __name__, "a test's backend", "cpu", ("in-place",), cpu_kernels=True
)


@pytest.fixture
def toy(monkeypatch):
    monkeypatch.setitem(backend_registry.BACKENDS, "toy", TOY)  # the registry entry
    ToyBackend.created.clear()
    ToyBackend.loaded.clear()
    return TOY


def test_the_toy_backends_rules_are_the_plans(toy, tiny_gqa):
    from nxdc.archs import spec_from_config
    from nxdc.compile.planning import make_plan
    from nxdc.plan import ExportOptions

    spec = spec_from_config(json.loads((tiny_gqa / "config.json").read_text()))
    plan = make_plan(spec, ExportOptions(**GQA_EXPORT, backend="toy"))
    assert (plan.backend, plan.kv_update) == ("toy", "in-place")
    with pytest.raises(UserInputError, match="at most 64 cache slots"):
        make_plan(spec, ExportOptions(backend="toy", sequence_length=128))
    with pytest.raises(UserInputError, match="the toy backend writes the KV cache in-place"):
        make_plan(spec, ExportOptions(**GQA_EXPORT, backend="toy", kv_update="functional"))
    help_text = backend_registry.help_text()
    assert "toy: a test's backend" in help_text["backend"] and "cpu (toy)" in help_text["device"]


@pytest.mark.slow
def test_export_and_generate_through_a_registered_backend(toy, tiny_gqa, tiny_gqa_export, tmp_path):
    from nxdc.pipeline import run_export
    from nxdc.plan import ExportOptions
    from nxdc.runtime.runner import Runner

    out = tmp_path / "toy"
    res = run_export(str(tiny_gqa), out, ExportOptions(**GQA_EXPORT, backend="toy"))
    assert ToyBackend.created and all(b.hit for b in res.buckets)  # inductor's entries, by its keys
    assert json.loads((out / "nxdc.json").read_text())["plan"]["backend"] == "toy"
    runner = Runner.load(out)
    assert sorted(ToyBackend.loaded) == sorted(b.name for b in res.buckets)  # every graph, by the toy
    torch.manual_seed(4)
    ids = torch.randint(3, 256, (2, 40))
    ref = Runner.load(tiny_gqa_export)
    for a, b in zip(
        nxdc_logits(ref.prefill, ref.decode, ids, [30, 7]),
        nxdc_logits(runner.prefill, runner.decode, ids, [30, 7]),
        strict=True,
    ):
        assert torch.equal(a, b)


def test_doctor_lists_a_registered_backend(toy):
    from nxdc.cli.main import app

    res = CliRunner().invoke(app, ["doctor", "--json"])
    checks = {c["name"]: c for c in json.loads(res.stdout)["checks"]}
    assert checks["backend toy"]["ok"] and "backend inductor/cpu" in checks


def test_the_registry_and_the_cli_load_without_torch():
    """The registry is data: reading every backend's rules (the CLI's help does at import) imports
    no backend code, so `nxdc --help`, `nxdc cache ...` and the serve front stay torch-free."""
    import subprocess
    import sys

    script = (
        "import sys; import nxdc.cli.main; from nxdc.compile.backends.registry import help_text, rules; "
        "help_text(); rules('neuron'); print(sorted(m for m in ('torch', 'nxdc.compile.backends.inductor') "
        "if m in sys.modules))"
    )
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert res.stdout.strip() == "[]", res.stdout + res.stderr[-2000:]
