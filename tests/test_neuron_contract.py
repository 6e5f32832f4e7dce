"""The neuron backend against a CONTRACT STAND-IN of the Neuron SDK (tests/neuron_standin/), not
a Neuron run: the stand-in enforces what neuronx-distributed's public source requires of its
callers (one forward signature across NxDModel.add()s, model_name routing, every traced weight
and state supplied per rank, NxD's default compiler flags, versions only in package metadata,
nothing of torch-neuronx pickled) and runs the traced graphs on the CPU, one thread per rank.
It proves that nxdc calls the API as the source requires; neuronx-cc, the NEFF, the Neuron
runtime and NeuronLink never run here (docs/neuron.md)."""

from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
import json
import os
import pickle
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tiny import GQA_EXPORT

from nxdc.pipeline import run_export
from nxdc.plan import ExportOptions

STANDIN = Path(__file__).parent / "neuron_standin"
SDK_MODULES = ("neuronx_distributed", "torch_neuronx", "neuronxcc", "libneuronxla", "torch_xla")
# the stand-in device's op registration must survive a re-import (torch.library is per process)
KEEP = ("torch_neuronx._standin_device", "torch_neuronx._standin_pickle")
PROMPTS = ["w1 w2 w3 w4 w5 w6", "w7 w8"]
ARGS = ("input_ids", "last_index", "positions", "rows", "start")  # nxdc's one neuron signature
SUFFIXES = {".neff", ".pb", ".json"}  # NEFF, HLO / metaneff protobuf bytes, the rest
NXD_DEFAULTS = ["--enable-saturate-infinity", "--auto-cast=none", "--model-type=transformer", "-O1"]
NXDC = [sys.executable, "-m", "nxdc.cli.main"]


def _purge() -> None:
    for name in list(sys.modules):
        if name.split(".")[0] in SDK_MODULES and name not in KEEP:
            del sys.modules[name]


@pytest.fixture(scope="module")
def standin():
    """The stand-in SDK importable in this process (and its LOG), for this module's tests only."""
    assert importlib.util.find_spec("neuronx_distributed") is None, "a real Neuron SDK is installed here"
    sys.path.insert(0, str(STANDIN))
    importlib.invalidate_caches()
    from torch_neuronx._standin_device import LOG

    try:
        yield LOG
    finally:
        sys.path.remove(str(STANDIN))
        _purge()
        importlib.invalidate_caches()


def _tokens(runner, tok, n=4):
    from nxdc.generation.loop import generate

    res = generate(runner, tok, PROMPTS, max_new_tokens=n, eos_ids=set())
    return [s.token_ids for s in res.sequences]


@pytest.fixture(scope="module")
def inductor_tokens(tiny_gqa_export):
    from transformers import AutoTokenizer

    from nxdc.runtime.runner import Runner

    return _tokens(Runner.load(tiny_gqa_export), AutoTokenizer.from_pretrained(tiny_gqa_export))


@dataclasses.dataclass
class NeuronRun:
    out: Path
    tp: int
    export_log: dict
    run_log: dict
    tokens: list
    runner_type: str
    session_device: str


def _snapshot(log) -> dict:
    out = {k: list(v) for k, v in log.items()}
    log.clear()
    return out


@pytest.fixture(scope="module", params=[1, 2], ids=["tp1", "tp2"])
def neuron_run(request, standin, tiny_gqa, cache_dir, tmp_path_factory) -> NeuronRun:
    from transformers import AutoTokenizer

    from nxdc.runtime.workers import open_runner

    tp = request.param
    standin.clear()
    out = tmp_path_factory.mktemp("neuron") / f"tiny-neuron-tp{tp}"
    run_export(str(tiny_gqa), out, ExportOptions(backend="neuron", device="trn1", tp=tp, **GQA_EXPORT))
    export_log = _snapshot(standin)
    runner = open_runner(out)
    tokens = _tokens(runner, AutoTokenizer.from_pretrained(out))
    runner.close()
    return NeuronRun(
        out, tp, export_log, _snapshot(standin), tokens, type(runner).__name__, runner.session.device
    )


# --- without the SDK ------------------------------------------------------------------------------
def test_without_the_sdk_neuron_is_refused_in_one_line(tiny_gqa, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    res = subprocess.run(
        [
            *NXDC,
            "export",
            str(tiny_gqa),
            "-o",
            str(tmp_path / "o"),
            "--backend",
            "neuron",
            "--device",
            "trn1",
        ],
        capture_output=True,
        text=True,
        env={**env, "NXDC_CACHE_DIR": str(tmp_path / "cache")},
        timeout=120,
    )
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2 and len(lines) == 1, res.stderr
    for pip in ("torch-neuronx", "neuronx-cc", "neuronx-distributed", "libneuronxla"):
        assert pip in lines[0]
    assert not (tmp_path / "o").exists()


# --- the stand-in enforces the rules (so that the tests below can fail) ------------------------
def test_standin_enforces_nxd_rules(standin, tmp_path):
    import torch_neuronx.xla_impl.structure as structure
    from neuronx_distributed import NxDModel, NxDParallelState
    from neuronx_distributed.trace.functions import compile as nxd_compile
    from neuronx_distributed.trace.functions import trace as nxd_trace
    from neuronx_distributed.trace.model_builder_utils import CompilationArtifacts

    class Ctx(torch.nn.Module):  # nxdc's old context and decode signatures
        def forward(self, input_ids, last_index):
            return input_ids.float().sum(-1) + last_index

    class Dec(torch.nn.Module):
        def forward(self, input_ids, positions):
            return input_ids.float().sum(-1) + positions

    ids, idx = torch.zeros(2, 4, dtype=torch.int32), torch.zeros(2, dtype=torch.int32)
    with NxDParallelState():
        traced = [nxd_trace(m(), args=(ids, idx)) for m in (Ctx, Dec)]
        neffs = [
            nxd_compile(t.hlo, t.metaneff, tmp_path, "--target trn1", key=f"k{i}")
            for i, t in enumerate(traced)
        ]
        with pytest.raises(RuntimeError, match="--target"):
            nxd_compile(traced[0].hlo, traced[0].metaneff, tmp_path, key="x")  # no target off a device
    model = NxDModel(world_size=1).add("ctx", traced[0], CompilationArtifacts(neffs[0].neff_filepath))
    with pytest.raises(AssertionError, match="different signature"):
        model.add("dec", traced[1], CompilationArtifacts(neffs[1].neff_filepath))
    with pytest.raises(TypeError, match="must not be pickled"):
        torch.save(traced[0], tmp_path / "trace.pt")
    with pytest.raises(TypeError, match="must not be pickled"):
        pickle.dumps(structure.Flattener((0,), None))
    with pytest.raises(ValueError, match="not on the CPU"), NxDParallelState():
        nxd_trace(torch.nn.Linear(2, 2, device="meta"), args=(torch.zeros(2),))
    with pytest.raises(RuntimeError, match="set_weights"):
        model(ids, idx, model_name="ctx")
    import neuronx_distributed
    import neuronxcc

    assert not hasattr(neuronx_distributed, "__version__") and not hasattr(neuronxcc, "__version__")
    standin.clear()


# --- 1. the target is a compile flag, never a torch device ----------------------------------------
def test_target_is_not_a_torch_device(standin, tiny_gqa):
    from nxdc.archs import spec_from_config
    from nxdc.compile.backends.registry import host_device
    from nxdc.compile.planning import make_plan
    from nxdc.compile.trace import build_decoder

    spec = spec_from_config(json.loads((tiny_gqa / "config.json").read_text()))
    for device in ("trn1", "trn2", "inf2"):
        plan = make_plan(spec, ExportOptions(backend="neuron", device=device))
        assert host_device(plan) == "cpu"
        assert {p.device.type for p in build_decoder(spec, plan, host_device(plan)).parameters()} == {"cpu"}


def test_tracing_and_weights_stay_on_the_cpu(neuron_run):
    assert neuron_run.session_device == "cpu"
    assert json.loads((neuron_run.out / "nxdc.json").read_text())["plan"]["device"] == "trn1"
    for call in neuron_run.run_log["set_weights"]:  # the stand-in refuses non-CPU tensors too
        assert all(t.device.type == "cpu" for rank in call["ranks"] for t in rank.values())


# --- 2. versions from package metadata ---------------------------------------------------------
def test_versions_come_from_package_metadata(standin):
    from nxdc.compile.backends.neuron import MODULES, NeuronBackend

    parts = NeuronBackend("trn1").key_parts()
    assert parts["versions"] == {pip: importlib.metadata.version(pip) for pip in MODULES.values()}
    assert importlib.metadata.version("neuronx-distributed") in parts["isa"]


# --- 3. one NxDModel, one forward signature, int32 inputs, model_name per bucket ----------------
def test_one_signature_across_buckets(neuron_run):
    plan = json.loads((neuron_run.out / "nxdc.json").read_text())["plan"]
    names = [f"{b['kind']}-{b['length']}" for b in plan["buckets"]]
    log = neuron_run.export_log
    assert len(log["trace"]) == len(names)
    for t in log["trace"]:
        assert t["params"] == list(ARGS)
        assert all(dtype == torch.int32 for _, dtype in t["args"].values())
    run = neuron_run.run_log
    assert run["nxd_model"] == [{"world_size": neuron_run.tp}]  # one NxDModel for every bucket
    assert sorted(a["key"] for a in run["add"]) == sorted(names)
    assert {tuple(a["params"]) for a in run["add"]} == {ARGS}
    called = {f["model_name"] for f in run["forward"]}
    assert {"context-16", "decode-32"} <= called  # a short prompt, 4 tokens
    assert all(d == torch.int32 for f in run["forward"] for d in f["dtypes"])


# --- 4. persistence through protobuf bytes and JSON, nothing pickled --------------------------
def test_artifacts_are_bytes_and_json(neuron_run):
    manifest = json.loads((neuron_run.out / "nxdc.json").read_text())
    for name, art in manifest["artifacts"].items():
        assert {Path(f).suffix for f in art["files"]} == SUFFIXES, name
        doc = json.loads((neuron_run.out / art["files"]["trace.json"]["path"]).read_text())
        assert [a["name"] for a in doc["provided_args"]] == list(ARGS)
        assert [a["dtype"] for a in doc["provided_args"]] == ["int32"] * len(ARGS)
    assert not list(neuron_run.out.rglob("*.pt"))


# --- 5. no uninitialised state traced; every traced name is provided --------------------------
def test_no_garbage_is_traced(neuron_run):
    from nxdc.model.decoder import GRAPH_PREFIX

    log, run = neuron_run.export_log, neuron_run.run_log
    ranks = run["set_weights"][0]["ranks"]
    assert len(ranks) == neuron_run.tp
    consts = ["rope_cos", "rope_sin"] + (["tp_rank"] if neuron_run.tp > 1 else [])
    for t in log["trace"]:
        assert t["folded"] == []  # nothing baked into the graph as a constant
        assert set(t["weights"]) <= set(ranks[0])  # every traced weight comes from set_weights
        for c in consts:  # what the tracer saw is what the runtime hands in
            assert torch.equal(t["seen"][GRAPH_PREFIX + c], ranks[0][GRAPH_PREFIX + c]), c
    if neuron_run.tp > 1:
        assert [int(r[GRAPH_PREFIX + "tp_rank"]) for r in ranks] == list(range(neuron_run.tp))


# --- 6. compiler flags: NxD's defaults plus nxdc's, the final list in the key ---------------
def test_compiler_flags_keep_nxd_defaults(neuron_run, cache_dir):
    log = neuron_run.export_log
    for c in log["compile"]:
        flags = shlex.split(c["compiler_args"])
        assert flags[: len(NXD_DEFAULTS)] == NXD_DEFAULTS
        assert "--target" in flags and flags[flags.index("--target") + 1] == "trn1" and "--lnc=1" in flags
        assert c["final"] == c["compiler_args"]  # NxD added nothing: its defaults were there
    metas = [json.loads(p.read_text()) for p in cache_dir.glob("compile/neuron-*/*/meta.json")]
    keyed = {tuple(m["parts"]["flags"]) for m in metas}
    assert {tuple(shlex.split(c["compiler_args"])) for c in log["compile"]} <= keyed


def test_trn2_compiles_with_its_logical_core_size(standin, tiny_gqa, tmp_path):
    standin.clear()
    opts = ExportOptions(backend="neuron", device="trn2", sequence_length=32, context_buckets=(16,))
    run_export(str(tiny_gqa), tmp_path / "o", opts)
    for c in standin["compile"]:
        assert "--lnc=2" in shlex.split(c["compiler_args"]) and c["parallel_state"]["lnc_size"] == 2
    standin.clear()


# --- 7. tp > 1: one process, NxDModel(world_size=tp), every rank's weights -------------------
def test_tensor_parallel_runs_in_one_process(neuron_run):
    assert neuron_run.runner_type == "Runner"  # no worker processes
    for t in neuron_run.export_log["trace"]:
        ps = t["parallel_state"]
        assert ps["world_size"] == ps["tensor_model_parallel_size"] == neuron_run.tp
    groups = {json.dumps(a["groups"]) for a in neuron_run.export_log.get("all_reduce", [])}
    assert groups == (set() if neuron_run.tp == 1 else {json.dumps([list(range(neuron_run.tp))])})


# --- 8. KV caches are aliased state, not outputs ----------------------------------------------
def test_kv_caches_are_aliased_state(neuron_run):
    from nxdc.model.decoder import GRAPH_PREFIX, kv_cache_names
    from nxdc.spec import ModelSpec

    spec = ModelSpec.from_dict(json.loads((neuron_run.out / "nxdc.json").read_text())["spec"])
    kv = [GRAPH_PREFIX + n for n in kv_cache_names(spec)]
    for t in neuron_run.export_log["trace"]:
        assert t["states"] == kv  # re-assigned buffers: NxD aliases them (no host copy per step)
    for a in json.loads((neuron_run.out / "nxdc.json").read_text())["artifacts"].values():
        doc = json.loads((neuron_run.out / a["files"]["trace.json"]["path"]).read_text())
        assert doc["states"] == kv and doc["packer"]["layout"] == "0"  # one output: the logits


# --- end to end: export -> load -> 4-token generate equals inductor ----------------------------
def test_generate_equals_inductor(neuron_run, inductor_tokens):
    assert neuron_run.tokens == inductor_tokens


def test_cli_export_and_generate_with_standin(tiny_gqa, tiny_gqa_export, tmp_path):
    from transformers import AutoTokenizer

    from nxdc.generation.loop import generate
    from nxdc.runtime.runner import Runner

    env = {**os.environ, "PYTHONPATH": str(STANDIN), "NXDC_CACHE_DIR": str(tmp_path / "cache")}
    flags = ["--batch-size", "2", "--sequence-length", "64", "--context-buckets", "16,32"]
    flags += ["--decode-buckets", "32,64", "--backend", "neuron", "--device", "trn1", "--tp", "2"]
    out = tmp_path / "o"
    res = subprocess.run(
        [*NXDC, "export", str(tiny_gqa), "-o", str(out), "-q", *flags],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr
    res = subprocess.run(
        [*NXDC, "generate", str(out), "--prompt", PROMPTS[0], "--max-new-tokens", "4", "--json"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr
    got = json.loads(res.stdout)["results"][0]["token_ids"]
    tok = AutoTokenizer.from_pretrained(tiny_gqa_export)
    ref = generate(Runner.load(tiny_gqa_export), tok, PROMPTS[:1], max_new_tokens=4)
    assert got == ref.sequences[0].token_ids
