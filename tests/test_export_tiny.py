"""Compiled path on tiny random models: logits and greedy text match transformers, the
cache makes the second export compile nothing, corrupt entries are rebuilt, interrupted
exports leave nothing behind."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from parity import hf_greedy, max_error, nxdc_logits, reference_logits
from tiny import GQA_EXPORT

from nxdc.cache.store import CompileCache
from nxdc.pipeline import run_export
from nxdc.plan import ExportOptions
from nxdc.runtime.runner import Runner

pytestmark = pytest.mark.slow


def hf_model(path, dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()


def test_compiled_logits_match_transformers_fp32_gqa(tiny_gqa, tiny_gqa_export):
    sess = Runner.load(tiny_gqa_export)
    torch.manual_seed(3)
    ids = torch.randint(3, 256, (2, 40))
    lens = [30, 7]  # prefill in bucket 32; decode crosses from the 32-slot to the 64-slot graph
    ref = reference_logits(hf_model(tiny_gqa), ids)
    err = max_error(ref, nxdc_logits(sess.prefill, sess.decode, ids, lens), lens)
    assert err < 2e-5, err


def test_compiled_logits_match_transformers_bf16_mha_tied(tiny_mha_bf16_export):
    src, out = tiny_mha_bf16_export
    sess = Runner.load(out)
    torch.manual_seed(4)
    ids = torch.randint(3, 256, (1, 30))
    ref = reference_logits(hf_model(src, torch.bfloat16), ids)
    err = max_error(ref, nxdc_logits(sess.prefill, sess.decode, ids, [11]), [11])
    assert err < 6e-2, err


def test_greedy_generation_matches_transformers(tiny_gqa, tiny_gqa_export):
    from transformers import AutoTokenizer

    from nxdc.generation.loop import generate

    tok = AutoTokenizer.from_pretrained(tiny_gqa_export)
    prompts = ["w1 w2 w3 w4 w5 w6", "w7 w8"]
    res = generate(Runner.load(tiny_gqa_export), tok, prompts, max_new_tokens=20, eos_ids=set())
    model = hf_model(tiny_gqa)
    for prompt, seq in zip(prompts, res.sequences, strict=True):
        ids = tok(prompt, return_tensors="pt").input_ids
        assert seq.token_ids == hf_greedy(model, ids, 20, pad_token_id=0)


def test_second_export_is_full_cache_hit(tiny_gqa, tiny_gqa_export, tmp_path, monkeypatch):
    from nxdc.compile.backends.inductor import InductorBackend

    def no_compile(*a, **k):
        raise AssertionError("compile called on a warm cache")

    monkeypatch.setattr(InductorBackend, "compile", no_compile)
    opts = ExportOptions(**GQA_EXPORT)
    res = run_export(str(tiny_gqa), tmp_path / "again", opts)
    assert [b.hit for b in res.buckets] == [True, True, True, True]
    a = json.loads((tiny_gqa_export / "nxdc.json").read_text())["artifacts"]
    b = json.loads((tmp_path / "again" / "nxdc.json").read_text())["artifacts"]
    assert {k: v["files"] for k, v in a.items()} == {k: v["files"] for k, v in b.items()}


def test_corrupt_entry_is_rebuilt(tiny_gqa, tiny_gqa_export, tmp_path, cache_dir):
    opts = ExportOptions(**GQA_EXPORT)
    manifest = json.loads((tiny_gqa_export / "nxdc.json").read_text())
    key = manifest["artifacts"]["decode-64"]["key"]
    entry = next(CompileCache(cache_dir).compile_dir.glob(f"*/{key}"))
    with open(entry / "model.pt2", "r+b") as f:  # flip bytes in the middle of the package
        f.seek(1000)
        f.write(b"\x00garbage\x00")
    res = run_export(str(tiny_gqa), tmp_path / "rebuilt", opts)
    by_name = {b.name: b for b in res.buckets}
    assert not by_name["decode-64"].hit
    assert "corrupt" in by_name["decode-64"].reason
    assert by_name["context-16"].hit and by_name["context-32"].hit
    # the rebuilt graph is sound: same logits as the original export
    ids = torch.randint(3, 256, (2, 12))
    a, b = Runner.load(tiny_gqa_export), Runner.load(tmp_path / "rebuilt")
    for s in (a, b):
        s.prefill([ids[0, :8].tolist(), ids[1, :5].tolist()])
    pos = torch.tensor([40, 35])  # positions >= 32: the decode-64 graph
    assert torch.equal(a.decode(ids[:, 8], pos), b.decode(ids[:, 8], pos))


def test_interrupted_export_leaves_nothing(tiny_gqa, tmp_path, monkeypatch):
    from nxdc.compile.backends.inductor import InductorBackend

    def interrupted(self, ep, out_dir, kind=None):
        (out_dir / "model.pt2").write_bytes(b"half-written")
        raise KeyboardInterrupt

    monkeypatch.setattr(InductorBackend, "compile", interrupted)
    cache = CompileCache(tmp_path / "cache")
    out = tmp_path / "out"
    with pytest.raises(KeyboardInterrupt):
        run_export(str(tiny_gqa), out, ExportOptions(sequence_length=64, context_buckets=(16,)), cache=cache)
    assert not out.exists()
    assert list(tmp_path.glob(".out*")) == []  # no temp export dir left
    assert list(cache.entries()) == []
    assert [p.name for p in cache.compile_dir.rglob("*") if p.is_dir() and p.name.startswith(".tmp")] == []


def test_reexport_replaces_only_when_complete(tiny_gqa, tiny_gqa_export, tmp_path, monkeypatch):
    """A failing re-export into an existing export dir keeps the old, complete export."""
    out = tmp_path / "keep"
    shutil.copytree(tiny_gqa_export, out)
    import nxdc.pipeline as ex

    def boom(*a, **k):
        raise RuntimeError("disk full")

    monkeypatch.setattr(ex, "write_weights", boom)
    with pytest.raises(RuntimeError):
        run_export(str(tiny_gqa), out, ExportOptions(**GQA_EXPORT))
    assert (out / "nxdc.json").is_file()
    Runner.load(out)  # still loads


def kernels_apply_here() -> bool:
    from nxdc.kernels import cpu_supported, disabled

    return cpu_supported() and not disabled()


def test_two_concurrent_exports_share_one_cache(tiny_gqa, tmp_path):
    """Two `nxdc export` processes on one empty cache: both succeed, each graph is compiled
    once (the per-key lock makes the second wait and take the first's entry), every entry
    verifies."""
    import os
    import subprocess
    import sys

    from nxdc.cache.store import verify_entry

    env = {**os.environ, "NXDC_CACHE_DIR": str(tmp_path / "cache")}
    args = ["--sequence-length", "32", "--context-buckets", "16", "--decode-buckets", "32", "--json"]
    cmd = [sys.executable, "-m", "nxdc.cli.main", "export", str(tiny_gqa)]
    procs = [
        subprocess.Popen(
            [*cmd, "-o", str(tmp_path / f"out{i}"), *args],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    results = [p.communicate(timeout=600) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [r[1] for r in results]
    summaries = [json.loads(out) for out, _ in results]
    assert sum(s["compiled"] for s in summaries) == 2  # context-16 and decode-32, once each
    entries = list(CompileCache(tmp_path / "cache").entries())
    assert all(verify_entry(d) is None for d, _ in entries)
    kernels = [d for d, _ in entries if d.parent.name.startswith("kernels-")]
    assert len(entries) - len(kernels) == 2  # the graphs
    assert len(kernels) == (1 if kernels_apply_here() else 0)  # the CPU kernels, built once for both
    for i in range(2):
        Runner.load(tmp_path / f"out{i}")
    # and `nxdc cache verify` (what a user runs) re-hashes every entry and finds nothing corrupt
    res = subprocess.run(
        [sys.executable, "-m", "nxdc.cli.main", "cache", "verify", "--json"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 0, res.stderr
    n = len(entries)
    assert json.loads(res.stdout) == {"checked": n, "ok": n, "corrupt": []}
