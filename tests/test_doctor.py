"""`nxdc doctor` reports this host as it is (no build, no network)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import torch

from nxdc.kernels import LIBRARY, cpu_isa, kernel_entry

NXDC = [sys.executable, "-m", "nxdc.cli.main", "doctor"]


def doctor(tmp_path, **env) -> dict[str, dict]:
    base = {k: v for k, v in os.environ.items() if k != "NXDC_CACHE_REMOTE"}
    e = {**base, "NXDC_CACHE_DIR": str(tmp_path / "cache"), **env}
    res = subprocess.run([*NXDC, "--json"], capture_output=True, text=True, env=e, timeout=120)
    assert res.returncode == 0, res.stderr
    return {c["name"]: c for c in json.loads(res.stdout)["checks"]}


def test_doctor_reports_this_machine(tmp_path):
    c = doctor(tmp_path)
    assert c["torch"]["detail"] == torch.__version__
    assert f"ISA {cpu_isa()}" in c["cpu"]["detail"]
    assert c["backend inductor/cpu"]["ok"]
    assert c["backend inductor/cuda"]["ok"] == torch.cuda.is_available()
    has_xla = importlib.util.find_spec("torch_xla") is not None
    assert c["backend xla"]["ok"] == has_xla and (has_xla or "make test-xla" in c["backend xla"]["detail"])
    neuron = c["backend neuron"]
    assert not neuron["ok"] and "torch-neuronx" in neuron["detail"] and "pip.repos.neuron" in neuron["detail"]
    assert c["cpu kernels"]["ok"] and "not built yet" in c["cpu kernels"]["detail"]
    assert str(tmp_path / "cache") in c["cache"]["detail"] and "no remote" in c["cache"]["detail"]
    assert not (tmp_path / "cache").exists()  # doctor creates nothing


def test_doctor_sees_built_kernels_and_a_missing_compiler(tmp_path):
    ns, key, _ = kernel_entry()
    lib = tmp_path / "cache" / "compile" / ns / key / LIBRARY
    lib.parent.mkdir(parents=True)
    lib.write_bytes(b"\0")
    c = doctor(tmp_path, CXX=str(tmp_path / "no-such-compiler"), NXDC_CACHE_REMOTE="file:///nowhere")
    assert c["cpu kernels"]["ok"] and key[:12] in c["cpu kernels"]["detail"]
    assert not c["backend inductor/cpu"]["ok"] and "no C++ compiler" in c["backend inductor/cpu"]["detail"]
    assert "file:///nowhere" in c["cache"]["detail"]


def test_doctor_prints_one_line_per_check(tmp_path):
    env = {**os.environ, "NXDC_CACHE_DIR": str(tmp_path / "cache")}
    res = subprocess.run(NXDC, capture_output=True, text=True, env=env, timeout=120)
    lines = res.stdout.strip().splitlines()
    assert res.returncode == 0 and len(lines) == len(doctor(tmp_path))
    assert all(line.startswith(("ok  ", "no  ")) for line in lines), lines
