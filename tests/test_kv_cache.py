"""``--kv-cache fp16 | bf16``: keys and values stored in 16 bits, attention computed in fp32.
Eagerly (both attention paths) the logits stay within a stated tolerance of transformers';
compiled at tp 2 with verify graphs they stay within it too, the runtime's caches hold the
16-bit format, and speculation reproduces plain greedy token for token; a bad value is refused
and the format is part of the compile-cache key."""

from __future__ import annotations

import json

import pytest
import torch
from parity import max_error, nxdc_logits, reference_logits, tiny_export_check
from test_parity_eager import build

from nxdc.kernels import ensure_loaded
from nxdc.model.decoder import ContextEncoding, Decoder, TokenGeneration

# Logits of magnitude ~1 through two layers: fp16 keeps 11 bits of each key / value, bf16 8.
KV_TOL = {"fp16": 2e-3, "bf16": 2e-2}
KV_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


@pytest.mark.parametrize("kernels", [True, False], ids=["nxdc-attend", "sdpa"])
@pytest.mark.parametrize("kv", sorted(KV_TOL))
def test_16_bit_kv_cache_stays_close_to_transformers(kv, kernels):
    if kernels and not ensure_loaded():
        pytest.skip("nxdc CPU kernels unavailable on this machine")
    hf, ref = build("gqa", torch.float32, batch=2, max_seq=32)
    ours = Decoder(ref.spec, 2, 32, torch.float32, kv_dtype=KV_DTYPES[kv], kernels=kernels).eval()
    ours.load_state_dict(
        {k: v for k, v in ref.state_dict().items() if not k.endswith("_cache")}, strict=False
    )
    assert ours.layers[0].self_attn.k_cache.dtype == KV_DTYPES[kv]
    torch.manual_seed(1)
    ids = torch.randint(3, 256, (2, 20))
    lens = [9, 5]
    ce, tg = ContextEncoding(ours), TokenGeneration(ours, 32)

    def prefill(prompts):
        x = torch.zeros(2, 16, dtype=torch.int64)
        for i, p in enumerate(prompts):
            x[i, : len(p)] = torch.tensor(p)
        with torch.no_grad():
            return ce(x, torch.tensor([len(p) - 1 for p in prompts]))

    def decode(toks, pos):
        with torch.no_grad():
            return tg(toks.view(-1, 1), pos)

    err = max_error(reference_logits(hf, ids), nxdc_logits(prefill, decode, ids, lens), lens)
    assert 1e-5 < err < KV_TOL[kv], err  # above fp32's error: the 16-bit cache is in use


def test_kv_cache_option_is_checked_and_keyed(tiny_gqa, tmp_path):
    from typer.testing import CliRunner

    from nxdc.archs import spec_from_config
    from nxdc.buckets import Bucket
    from nxdc.cli.main import app
    from nxdc.compile.backends.registry import get_backend
    from nxdc.compile.graph_keys import key_parts
    from nxdc.compile.planning import make_plan
    from nxdc.plan import ExportOptions

    r = CliRunner()
    bad = r.invoke(
        app, ["export", str(tiny_gqa), "-o", str(tmp_path / "x"), "--kv-cache", "fp8", "--dry-run"]
    )
    assert bad.exit_code == 2 and "--kv-cache must be one of fp32, fp16, bf16" in bad.output
    plans = {}
    for kv in ("fp32", "fp16"):
        res = r.invoke(
            app, ["export", str(tiny_gqa), "-o", str(tmp_path / "x"), "--kv-cache", kv, "--dry-run", "--json"]
        )
        assert res.exit_code == 0, res.output
        plans[kv] = json.loads(res.stdout)
    assert plans["fp16"]["plan"]["kv_cache"] == "fp16" and plans["fp32"]["plan"]["kv_cache"] is None
    assert plans["fp16"]["kv_cache_bytes"] * 2 == plans["fp32"]["kv_cache_bytes"]
    assert plans["fp16"]["weight_bytes"] == plans["fp32"]["weight_bytes"]

    spec = spec_from_config(json.loads((tiny_gqa / "config.json").read_text()))
    backend = get_backend("inductor", "cpu")
    keys = [
        key_parts(spec, make_plan(spec, ExportOptions(kv_cache=kv)), Bucket("decode", 64), backend, "k")
        for kv in (None, "bf16", "fp16")
    ]
    assert len({json.dumps(k, sort_keys=True) for k in keys}) == 3


def test_16_bit_kv_cache_compiled_tp2_with_speculation(
    tiny_gqa, tiny_gqa_export, tmp_path_factory, cache_dir
):
    from nxdc.pipeline import run_export
    from nxdc.plan import ExportOptions
    from nxdc.runtime.session import Session

    out = tmp_path_factory.mktemp("exports") / "tiny-kv-fp16-tp2"
    opts = dict(batch_size=2, sequence_length=64, context_buckets=(16,), decode_buckets=(64,))
    run_export(str(tiny_gqa), out, ExportOptions(tp=2, kv_cache="fp16", speculation_length=2, **opts))
    rank0 = Session(out, rank=0)
    caches = {n: t for n, t in rank0._constants().items() if n.endswith("_cache")}
    assert caches and all(t.dtype == torch.float16 for t in caches.values())
    err = tiny_export_check(out, tiny_gqa_export)
    assert 1e-5 < err < KV_TOL["fp16"], err
