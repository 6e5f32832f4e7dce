"""`nxdc bench` on a tiny export: the JSON has the documented shape and sane numbers (no
timing thresholds: speed is measured by benchmarks, not asserted by tests)."""

from __future__ import annotations

import json

import pytest
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


def test_compare_refuses_int8_weight_exports(tmp_path):
    from types import SimpleNamespace

    from nxdc.bench.reference import transformers_model
    from nxdc.errors import UserInputError

    for weights in ("int8", "int8-g32", "int4-asym-g32"):
        with pytest.raises(UserInputError, match=f"cannot rebuild a quantized-weight export \\({weights}"):
            plan = SimpleNamespace(tp=1, dtype="fp32", weights=weights)
            transformers_model(tmp_path, SimpleNamespace(plan=plan))
