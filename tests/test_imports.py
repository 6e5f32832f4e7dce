"""Imports run one way: cli → bench, serve, accuracy, doctor, api → pipeline → runtime, generation, sync →
compile, weights, manifest → plan, kernels → model, archs, buckets, cache (the local store) → spec,
errors. An AST walk over nxdc/ fails on any import of a higher layer, local (inside a function)
or not, so a cycle cannot hide in a function body."""

from __future__ import annotations

import ast
import importlib
import pkgutil
from pathlib import Path

import nxdc

ROOT = Path(nxdc.__file__).parent

# Each package's layer (a top-level module is a package of one). A module may import its own
# package and any package of a lower layer; nothing else. No module has a layer of its own.
LAYERS = {
    "nxdc": 0,
    "nxdc.errors": 0,
    "nxdc.spec": 0,
    "nxdc.cache": 1,  # hashing and the local store: what every layer that caches needs
    "nxdc.buckets": 1,
    "nxdc.progress": 1,
    "nxdc.archs": 1,
    "nxdc.model": 1,
    "nxdc.kernels": 2,
    "nxdc.plan": 2,
    "nxdc.manifest": 3,
    "nxdc.compile": 3,
    "nxdc.weights": 3,
    "nxdc.sync": 4,  # registry, remotes, transfer: read manifests and plans, compute keys
    "nxdc.runtime": 4,
    "nxdc.generation": 4,
    "nxdc.pipeline": 5,  # the export pipeline; records what it wrote in the cache registry
    "nxdc.accuracy": 6,
    "nxdc.api": 6,  # the public Python API (nxdc.export, ...), which the CLI is a layer over
    "nxdc.doctor": 6,
    "nxdc.bench": 6,
    "nxdc.serve": 6,
    "nxdc.cli": 7,
}


def layer(module: str) -> int:
    assert package(module) in LAYERS, f"{module}: its package has no layer; add it to LAYERS"
    return LAYERS[package(module)]


def package(module: str) -> str:
    return ".".join(module.split(".")[:2])


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT.parent).with_suffix("")
    return ".".join(rel.parts).removesuffix(".__init__")


def nxdc_imports(path: Path):
    """(line, imported module) for every nxdc import in the file; ``from nxdc.x import y`` counts
    as an import of ``nxdc.x.y`` where that is a module."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("nxdc"):
                    yield node.lineno, a.name
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("nxdc"):
            for a in node.names:
                sub = f"{node.module}.{a.name}"
                is_module = (ROOT.parent / sub.replace(".", "/")).with_suffix(".py").is_file() or (
                    ROOT.parent / sub.replace(".", "/")
                ).is_dir()
                yield node.lineno, sub if is_module else node.module


def test_imports_go_down_the_layers():
    bad = []
    for path in sorted(ROOT.rglob("*.py")):
        mod = module_name(path)
        for line, target in nxdc_imports(path):
            if package(target) == package(mod) and target != "nxdc":
                continue
            if layer(target) > layer(mod):
                bad.append(f"{path.relative_to(ROOT.parent)}:{line}: {mod} (layer {layer(mod)}) imports "
                           f"{target} (layer {layer(target)})")  # fmt: skip
    assert not bad, "upward imports:\n" + "\n".join(bad)


def test_the_rule_catches_an_upward_import(tmp_path):
    """The walk sees imports inside functions too (the ones that used to hide cycles)."""
    f = tmp_path / "x.py"
    f.write_text("def f():\n    from nxdc.cli.main import app\n")
    assert list(nxdc_imports(f)) == [(2, "nxdc.cli.main")]
    assert layer("nxdc.cli.main") > layer("nxdc.runtime.session")


def test_every_module_imports():
    """Every module imports (a moved name, or a cycle the layers above did not stop, fails here)."""
    for info in pkgutil.walk_packages([str(ROOT)], prefix="nxdc."):
        importlib.import_module(info.name)
