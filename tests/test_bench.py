"""`nxdc bench` on a tiny export: the JSON has the documented shape and sane numbers (no
timing thresholds: speed is measured by benchmarks, not asserted by tests)."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from nxdc.cli.main import app

pytestmark = pytest.mark.slow


def test_bench_json_schema_and_sanity(tiny_gqa_export, tmp_path):
    out = tmp_path / "bench.json"
    res = CliRunner().invoke(
        app,
        [
            "bench",
            str(tiny_gqa_export),
            "--batch-sizes",
            "1,2",
            "--prompt-lengths",
            "8,16",
            "--new-tokens",
            "6",
            "--runs",
            "2",
            "--compare",
            "transformers",
            "--json",
            str(out),
            "--plot",
            str(tmp_path / "b.png"),
        ],
    )
    assert res.exit_code == 0, res.stderr
    data = json.loads(out.read_text())
    assert data["schema"] == 1
    m = data["machine"]
    assert m["threads"] >= 1 and m["read_bandwidth_gbs"] > 0 and m["torch"]
    assert [(r["batch"], r["prompt_tokens"]) for r in data["rows"]] == [(1, 8), (1, 16), (2, 8), (2, 16)]
    for r in data["rows"]:
        assert r["runs"] == 2 and r["export_batch_size"] == 2 and r["new_tokens"] == 6
        assert 0 < r["itl_ms"]["p50"] <= r["itl_ms"]["p90"] <= r["itl_ms"]["p99"]
        for k in (
            "ttft_ms",
            "decode_tokens_per_s",
            "e2e_ms",
            "prefill_tokens_per_s",
            "peak_rss_mib",
            "bytes_per_decode_step",
            "fraction_of_read_roofline",
            "fraction_of_read_roofline_paired",
            "read_bandwidth_gbs",
        ):
            assert r[k] > 0, k
        assert r["e2e_ms"] >= r["ttft_ms"]
        assert 0 <= r["huge_page_fraction"] <= 1
        assert r["transformers"]["decode_tokens_per_s"] > 0
        assert r["ratio_vs_transformers"]["decode_tokens_per_s"] == pytest.approx(
            r["decode_tokens_per_s"] / r["transformers"]["decode_tokens_per_s"]
        )
    assert (tmp_path / "b.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    "flags, needle",
    [
        (["--batch-sizes", "3"], "exceeds the export's batch size 2"),
        (["--prompt-lengths", "60"], "exceeds the sequence length 64"),
        (["--prompt-lengths", "40", "--new-tokens", "4"], "largest context bucket"),
        (["--compare", "llamacpp"], "--compare takes 'transformers'"),
        (["--batch-sizes", "0"], "positive integers"),
    ],
)
def test_bench_bad_input(tiny_gqa_export, flags, needle):
    res = CliRunner().invoke(app, ["bench", str(tiny_gqa_export), "--runs", "1", *flags])
    assert res.exit_code == 2, res.stderr
    assert needle in res.stderr and "Traceback" not in res.stderr


@pytest.mark.parametrize("fmt", ["int8", "int4", "int4-sym"])
def test_compare_rebuilds_quantized_exports(tmp_path, fmt):
    """``--compare transformers`` on an int8 / int4 export runs transformers on the values the
    export holds (dequantized as nxdc's kernels read them): its logits are nxdc's eager logits
    on the same stored weights."""
    from types import SimpleNamespace

    from safetensors.torch import save_file
    from test_parity_eager import build
    from test_weights import _prefill_logits, _tiny_models

    from nxdc.bench.reference import transformers_model
    from nxdc.compile.planning import make_plan
    from nxdc.plan import ExportOptions

    hf, _ = build("gqa", torch.float32, batch=1, max_seq=32)
    _, low = _tiny_models(fmt, kernels=False)
    hf.config.save_pretrained(tmp_path)
    (tmp_path / "weights").mkdir()
    state = {k: v.contiguous() for k, v in low.state_dict().items() if not k.endswith("_cache")}
    save_file(state, str(tmp_path / "weights" / "rank0.safetensors"))
    plan = make_plan(
        low.spec, ExportOptions(batch_size=1, sequence_length=32, context_buckets=(16,), weights=fmt)
    )
    manifest = SimpleNamespace(
        plan=plan, spec=low.spec, rank_weights=lambda r: SimpleNamespace(path="rank0.safetensors")
    )
    model = transformers_model(tmp_path, manifest)
    torch.manual_seed(3)
    ids = torch.randint(3, 256, (1, 12))
    with torch.no_grad():
        theirs = model(ids).logits
    assert float((theirs - _prefill_logits(low)).abs().max()) < 1e-4
