"""Reduced-precision weights (``--weights fp16 | bf16 | int8 | int4 ...``): the model reads them through
nxdc's kernels, stays within its accuracy budget against fp32 weights, and the compiled,
exported path (tp 1 and tp 2) matches the eager one."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from cpu_paths import TILES, VNNI
from typer.testing import CliRunner

from nxdc.cli.main import app
from nxdc.kernels import ensure_loaded
from nxdc.model import weight_format
from nxdc.model.layers import Linear
from nxdc.pipeline import stored_tensors

FORMATS = ["fp16", "bf16", "int8"]
TINY_FORMATS = [*FORMATS, "int8-row", "int4", "int4-sym", "int4-g64", "int4-f32", "int8-f16"]
# tiny random model (logits ~1): max abs logit error vs fp32 weights
# (int8 step = max|w|/127 per row or group; int4 = max|w|/8 or (max - min)/15 per group)
TINY_TOL = {
    "fp16": 2e-3,
    "bf16": 2e-2,
    "int8": 1e-1,
    "int8-row": 1e-1,
    "int4": 1.0,
    "int4-sym": 1.0,
    "int4-g64": 1.0,
    "int4-f32": 1.0,
    "int8-f16": 1e-1,
}
STORED_DTYPE = {"fp16": torch.float16, "bf16": torch.bfloat16, "int8": torch.int8, "int4": torch.uint8}


def _tiny_models(fmt: str, kernels: bool, case: str = "gqa"):
    from test_parity_eager import build

    _, ref = build(case, torch.float32, batch=1, max_seq=32, kernels=kernels)
    from nxdc.model.decoder import Decoder

    canonical = weight_format.from_user(fmt).name
    low = Decoder(ref.spec, 1, 32, torch.float32, weights=canonical, kernels=kernels).eval()
    state = {}
    meta = low.state_dict()
    for name, t in ref.state_dict().items():
        if name.endswith("_cache"):
            continue
        state.update(stored_tensors(name, t, meta[name].dtype, weight_format.module_format(canonical, name)))
    low.load_state_dict(state, strict=False)
    return ref, low


def _prefill_logits(model, t: int = 12) -> torch.Tensor:
    torch.manual_seed(3)
    ids = torch.randint(3, 256, (1, t))
    pos = torch.arange(t)
    mask = (pos.view(1, t) <= pos.view(t, 1)).view(1, 1, t, t)
    with torch.no_grad():
        return model(ids, pos.view(1, t), mask, None, None, every_position=True)


@pytest.mark.parametrize("kernels", [True, False], ids=["nxdc-kernels", "pytorch"])
@pytest.mark.parametrize("fmt", TINY_FORMATS)
def test_reduced_weights_stay_close_to_fp32_tiny(fmt, kernels):
    if kernels and not ensure_loaded():
        pytest.skip("nxdc CPU kernels unavailable on this machine")
    ref, low = _tiny_models(fmt, kernels)
    lin = low.layers[0].self_attn.qkv_proj
    f = weight_format.from_user(fmt)
    assert isinstance(lin, Linear) and lin.weight.dtype == STORED_DTYPE[f.kind]
    if f.quantized:  # the scales the format names: per row, or one per group of G inputs
        k = lin.weight.shape[1] * (2 if f.kind == "int4" else 1)
        assert lin.scale.shape == (
            (lin.weight.shape[0],) if f.group is None else (lin.weight.shape[0], k // f.group)
        )
        assert hasattr(lin, "min") == f.asym
        # int4: fp16 scales unless -f32; int8: fp32 unless -f16
        assert lin.scale.dtype == (torch.float16 if f.scales == "f16" else torch.float32)
    err = float((_prefill_logits(ref) - _prefill_logits(low)).abs().max())
    assert 0 < err < TINY_TOL[fmt], err  # > 0: the format really is in use


def test_two_level_int4_tiny():
    """``--weights int4-k`` on a tiny model whose every row has a multiple of 256 inputs: two-level
    scales and mins (uint8), close to fp32 weights, the kernels and PyTorch's path agreeing; the
    embedding and lm_head keep fp16 scales (an embedding lookup reads no two-level ones)."""
    if not ensure_loaded():
        pytest.skip("nxdc CPU kernels unavailable on this machine")
    ref, low = _tiny_models("int4-k", True, "wide")
    _, eager = _tiny_models("int4-k", False, "wide")
    for lin in (low.layers[0].self_attn.qkv_proj, low.layers[1].mlp.down_proj):
        k = lin.weight.shape[1] * 2
        assert lin.scale.dtype == lin.min.dtype == torch.uint8
        assert lin.scale.shape == (lin.weight.shape[0], 2 * k // 256 + k // 32)
    assert low.lm_head.scale.dtype == low.embed_tokens.scale.dtype == torch.float16
    out, back, want = _prefill_logits(low), _prefill_logits(eager), _prefill_logits(ref)
    err = float((want - out).abs().max())
    # this model's logits reach ~5: int4 with fp32 scales errs by ~1.9 (two-level measured 2.05)
    f32 = float((want - _prefill_logits(_tiny_models("int4-f32", True, "wide")[1])).abs().max())
    assert 0 < err < 1.25 * f32, (err, f32)
    assert float((out - back).abs().max()) < 1e-4


def test_kernel_and_pytorch_paths_agree_tiny():
    """The kernels read the stored weights; PyTorch's path converts them per call: same math."""
    if not ensure_loaded():
        pytest.skip("nxdc CPU kernels unavailable on this machine")
    for fmt in TINY_FORMATS:
        a = _prefill_logits(_tiny_models(fmt, True)[1])
        b = _prefill_logits(_tiny_models(fmt, False)[1])
        assert float((a - b).abs().max()) < 1e-4, fmt


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_half_dtype_takes_the_kernels_tiny(dtype):
    """``--dtype bf16 / fp16`` (weights, activations and KV cache in that dtype) runs nxdc's
    linear, SwiGLU and attention kernels, not PyTorch's half-precision ops, and gives what the
    PyTorch path and transformers give within the dtype's rounding."""
    if not ensure_loaded():
        pytest.skip("nxdc CPU kernels unavailable on this machine")
    from test_parity_eager import build

    hf, ours = build("gqa", dtype, batch=1, max_seq=32)
    pytorch = _prefill_logits(ours)
    _, ours = build("gqa", dtype, batch=1, max_seq=32, kernels=True)  # the same weights
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        kernels = _prefill_logits(ours)
    called = {e.key for e in prof.key_averages()}
    op = {torch.bfloat16: "nxdc::linear_bf16", torch.float16: "nxdc::linear_f16"}[dtype]
    assert {op, "nxdc::swiglu", "nxdc::attend"} <= called, sorted(k for k in called if "nxdc" in k)
    torch.manual_seed(3)
    ids = torch.randint(3, 256, (1, 12))
    with torch.no_grad():
        ref = hf(ids).logits.float()
    tol = 6e-2 if dtype == torch.bfloat16 else 1e-2
    assert float((kernels.float() - pytorch.float()).abs().max()) < tol
    assert float((kernels.float()[0] - ref[0]).abs().max()) < tol


@pytest.mark.slow
def test_smollm2_accuracy_budget():
    """The budget, on the fixed evaluation text: fp16/bf16 within a logit tolerance and
    near-perfect top-1 agreement; int8 (groups of 32) top-1 >= 99% and perplexity within 2% of
    fp32; int4 top-1 >= 90% and perplexity within 5%."""
    from nxdc.accuracy import measure_formats
    from nxdc.plan import ExportOptions

    res = {
        r["weights"]: r
        for r in measure_formats(
            "smollm2-135m", ExportOptions(sequence_length=512, decode_matmul="int8"), [*FORMATS, "int4"]
        )
    }
    print(json.dumps(res, indent=1))
    assert res["fp16"]["max_abs_logit_error"] < 0.1 and res["fp16"]["top1_agreement"] >= 0.99
    assert res["bf16"]["max_abs_logit_error"] < 1.0 and res["bf16"]["top1_agreement"] >= 0.97
    assert res["int8"]["top1_agreement"] >= 0.99  # groups of 32: 99.3% (per row: 95.6%)
    assert abs(res["int8"]["perplexity_ratio"] - 1) <= 0.02
    # int4 (asymmetric, g32) re-finds the Q4_1 grid the embedded SmolLM2 was stored on
    assert res["int4"]["top1_agreement"] >= 0.9 and abs(res["int4"]["perplexity_ratio"] - 1) <= 0.05
    for fmt, r in res.items():  # > 0: the format really is in use; int4 holds the Q4_1 values exactly
        assert r["tokens"] > 200 and (r["max_abs_logit_error"] == 0.0) == (fmt == "int4"), (fmt, r)
    # decode's int8 activations (--decode-matmul int8 here, VNNI CPUs): every integer format,
    # within its budget's perplexity, top-1 at most 4 points below (measured: int8 96.3%, int4 97.6%)
    assert all(("decode" in r) == (VNNI and f in ("int8", "int4")) for f, r in res.items()), res
    for fmt, ppl in (("int8", 0.02), ("int4", 0.05)) if VNNI else ():
        d = res[fmt]["decode"]
        assert d["top1_agreement"] >= 0.96 and d["max_abs_logit_error"] > 0, (fmt, d)
        assert (
            abs(d["perplexity_ratio"] - 1) <= ppl and d["top1_agreement"] >= res[fmt]["top1_agreement"] - 0.04
        )


@pytest.fixture(scope="session")
def smollm2_int8_export(cache_dir, tmp_path_factory):
    from nxdc.pipeline import run_export
    from nxdc.plan import ExportOptions

    out = tmp_path_factory.mktemp("exports") / "smollm2-int8"
    opts = ExportOptions(batch_size=1, sequence_length=128, context_buckets=(64,), weights="int8")
    run_export("smollm2-135m", out, opts)
    return out


@pytest.mark.slow
def test_smollm2_int8_export_matches_eager_int8(smollm2_int8_export, smollm2_export):
    """The compiled int8 graphs compute what the eager int8 model computes (the accuracy
    budget above is measured eagerly), the file holds int8, and greedy text stays close to
    fp32's: 32 tokens identical on some prompts (int8 may take the other side of a near-tie)."""
    from parity import max_error, nxdc_logits
    from safetensors import safe_open
    from test_smollm2 import PROMPTS
    from transformers import AutoTokenizer

    from nxdc.compile.trace import rank_weight_bytes
    from nxdc.generation.loop import encode_prompts, generate
    from nxdc.runtime.runner import Runner

    d = smollm2_int8_export
    assert json.loads((d / "nxdc.json").read_text())["plan"]["weights"] == "int8-g32"
    with safe_open(str(d / "weights" / "rank0.safetensors"), "pt") as f:
        assert f.get_slice("layers.0.mlp.gate_up_proj.weight").get_dtype() == "I8"
        assert "layers.0.mlp.gate_up_proj.scale" in f.keys()
    sess = Runner.load(d)
    fp32 = rank_weight_bytes(sess.spec, dataclasses.replace(sess.plan, weights=None, weight_map=None))
    assert (d / "weights" / "rank0.safetensors").stat().st_size < 0.3 * fp32
    tok = AutoTokenizer.from_pretrained(d)
    ids = torch.tensor([encode_prompts(tok, [PROMPTS[0]], chat=True)[0] + [504, 3458, 282, 4649, 314]])
    n = ids.shape[1] - 5
    eager = _eager_of(d, sess.spec, "int8-g32")
    assert (
        max_error(_prefill_logits_of(eager, ids), nxdc_logits(sess.prefill, sess.decode, ids, [n]), [n])
        < 2e-3
    )

    ref = Runner.load(smollm2_export)
    same = []  # greedy's first 32 tokens identical to fp32's, prompt by prompt
    for p in PROMPTS:
        a = generate(sess, tok, [p], max_new_tokens=32, chat=True, eos_ids=set()).sequences[0].token_ids
        b = generate(ref, tok, [p], max_new_tokens=32, chat=True, eos_ids=set()).sequences[0].token_ids
        same.append(a == b)
    print(f"int8 greedy: 32 tokens identical to fp32's on {sum(same)} of {len(same)} prompts")
    # measured 3 of 4 (the least-error scale over t in 0..32; 1 of 4 with t in 0..2): the haiku
    # prompt's third token is a near-tie (fp32 margin 0.008) that bf16 weights flip too. The
    # target: 2 of 3 prompts; over 20 chat prompts int8 keeps about half (bench/int8_scales.py)
    assert sum(same) >= 3, same


@pytest.mark.slow
def test_smollm2_int8_prompt_tiles(smollm2_int8_export, tmp_path_factory):
    """``--prefill-matmul tiles-int8``: the int8 export's prompt graph on bf16 tiles (activations
    as two bf16 parts, weights rounded to bf16) computes what the eager model computes in that
    mode, and stays within the tiles' budget of the exact int8 prompt (0.5, as int4's)."""
    from test_smollm2 import PROMPTS
    from transformers import AutoTokenizer

    from nxdc.generation.loop import encode_prompts
    from nxdc.model.layers import prefill_matmuls
    from nxdc.pipeline import run_export
    from nxdc.plan import ExportOptions
    from nxdc.runtime.runner import Runner

    out = tmp_path_factory.mktemp("exports") / "smollm2-int8-tiles"
    opts = ExportOptions(
        batch_size=1, sequence_length=128, context_buckets=(64,), weights="int8", prefill_matmul="tiles-int8"
    )
    run_export("smollm2-135m", out, opts)
    tiles, exact = Runner.load(out), Runner.load(smollm2_int8_export)
    eager = _eager_of(out, tiles.spec, "int8-g32")
    tok = AutoTokenizer.from_pretrained(out)
    for p in PROMPTS:
        ids = encode_prompts(tok, [p], chat=True)[0]
        got, want = tiles.prefill([ids])[0].float(), exact.prefill([ids])[0].float()
        with prefill_matmuls("tiles-int8"):  # the prompt's last position: its lm_head row is exact
            ref = _prefill_logits_of(eager, torch.tensor([ids]), every_position=False)[0]
        err, moved = float((got - ref).abs().max()), float((got - want).abs().max())
        print(f"tiles-int8 prompt logits: {err:.2e} from eager tiles-int8, {moved:.3f} from exact")
        assert err < 2e-3, err  # measured 1.9e-4 .. 4.7e-4
        assert (moved > 0) == TILES and moved < 0.5, moved


def _eager_of(export, spec, weights: str):
    """The eager decoder of a tp 1 export's weights (its tied lm_head as the embedding)."""
    from safetensors.torch import load_file

    from nxdc.model.decoder import Decoder, tie_lm_head

    eager = Decoder(spec, 1, 128, torch.float32, weights=weights, kernels=bool(ensure_loaded())).eval()
    state = load_file(str(export / "weights" / "rank0.safetensors"))
    tie_lm_head(state)
    eager.load_state_dict(state, strict=False)
    return eager


def _prefill_logits_of(model, ids: torch.Tensor, every_position: bool = True) -> torch.Tensor:
    t = ids.shape[1]
    pos = torch.arange(t)
    mask = (pos.view(1, t) <= pos.view(t, 1)).view(1, 1, t, t)
    with torch.no_grad():
        return model(ids, pos.view(1, t), mask, None, None, every_position=every_position)


def test_weights_option_validation(tiny_gqa, tmp_path):
    r = CliRunner()

    def dry(*flags):
        return r.invoke(app, ["export", str(tiny_gqa), "-o", str(tmp_path / "x"), "--dry-run", *flags])

    bad = dry("--weights", "int3")
    assert bad.exit_code != 0 and "--weights must be one of" in bad.output
    # hidden 64: a 128-input group does not divide it; int4 groups are whole 32-weight blocks
    for flags, why in [
        (("--weights", "int4-g128"), "which 128-weight groups do not divide"),
        (("--weights", "int8-g64", "--tp", "2"), "o_proj (per rank) has 32 inputs"),
        (("--weights", "int4-g48"), "multiple of 32"),
        (("--weights", "int8-g8"), "multiple of 16"),
        (("--weights", "int8-asym"), "not a choice"),
        (("--weights", "int4-k"), "which 256-weight super-blocks do not divide"),
        (("--weights", "int4-g96-k"), "groups that divide 256 weights"),
        (("--weights", "int8-k"), "two-level (-k) scales are for int4"),
    ]:
        res = dry(*flags)
        assert res.exit_code != 0 and why in res.output and "Traceback" not in res.output, res.output
        assert len(res.output.strip().splitlines()) == 1, res.output
    mixed = r.invoke(
        app,
        [
            "export",
            str(tiny_gqa),
            "-o",
            str(tmp_path / "x"),
            "--weights",
            "int8",
            "--dtype",
            "bf16",
            "--dry-run",
        ],
    )
    assert mixed.exit_code != 0 and "needs --dtype fp32" in mixed.output
    noweights = r.invoke(app, ["export", str(tiny_gqa), "-o", str(tmp_path / "x"), "--check-accuracy"])
    assert noweights.exit_code != 0 and "pass one of them" in noweights.output
    ok = r.invoke(
        app, ["export", str(tiny_gqa), "-o", str(tmp_path / "x"), "--weights", "int8", "--dry-run", "--json"]
    )
    assert ok.exit_code == 0, ok.output
    s = json.loads(ok.stdout)
    fp32 = json.loads(
        r.invoke(app, ["export", str(tiny_gqa), "-o", str(tmp_path / "x"), "--dry-run", "--json"]).stdout
    )
    assert s["plan"]["weights"] == "int8-g32" and s["weight_bytes"] < 0.3 * fp32["weight_bytes"]
    i4 = json.loads(dry("--weights", "int4", "--json").stdout)
    # 4 bits + a 16-bit scale and min per 32 weights (5 bits) in the layers; the embedding and lm_head
    # (a third of this tiny model) stay int8 g32 with fp16 scales (8.5 bits): ~0.67 of the int8 bytes
    assert i4["plan"]["weights"] == "int4-asym-g32-f16" and i4["weight_bytes"] < s["weight_bytes"] * 0.7
    i4f32 = json.loads(dry("--weights", "int4-f32", "--json").stdout)  # fp32 scales, as before
    assert i4f32["plan"]["weights"] == "int4-asym-g32" and i4f32["weight_bytes"] > i4["weight_bytes"]
    assert json.loads(dry("--weights", "int8-f16", "--json").stdout)["plan"]["weights"] == "int8-g32-f16"
    assert json.loads(dry("--weights", "int8-row", "--json").stdout)["plan"]["weights"] == "int8"
    # auto keeps a GGUF file's formats; a safetensors checkpoint has none: the compute dtype
    auto = json.loads(dry("--weights", "auto", "--json").stdout)
    assert auto["plan"]["weights"] is None and auto["plan"]["weight_map"] is None
    assert auto["weight_bytes"] == fp32["weight_bytes"]


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_quantized_weights_under_tp2_and_speculation(
    fmt, tiny_gqa, tiny_gqa_export, tmp_path_factory, cache_dir
):
    """int8 / int4 weights, quantised per rank after sharding (groups never straddle a rank's
    cut), at tp 2 (worker processes): logits stay within the format's budget of fp32 tp 1, and
    prompt-lookup speculation on the same export reproduces its plain greedy output."""
    from parity import tiny_export_check

    from nxdc.pipeline import run_export
    from nxdc.plan import ExportOptions

    out = tmp_path_factory.mktemp("exports") / f"tiny-{fmt}-tp2"
    opts = dict(batch_size=2, sequence_length=64, context_buckets=(16,), decode_buckets=(64,))
    run_export(str(tiny_gqa), out, ExportOptions(tp=2, weights=fmt, speculation_length=2, **opts))
    err = tiny_export_check(out, tiny_gqa_export)
    assert 0 < err < TINY_TOL[fmt], err


def test_kv_cache_follows_16bit_weights_by_default(tiny_gqa, tmp_path):
    """fp16 / bf16 weights store the KV cache in their format unless --kv-cache says otherwise;
    fp32 and int8 weights keep it in the --dtype; the dry run's sizes follow the plan."""
    r = CliRunner()

    def plan(*flags):
        res = r.invoke(
            app, ["export", str(tiny_gqa), "-o", str(tmp_path / "x"), "--dry-run", "--json", *flags]
        )
        assert res.exit_code == 0, res.output
        return json.loads(res.stdout)

    fp32 = plan()
    for w in ("fp16", "bf16"):
        s = plan("--weights", w)
        assert s["plan"]["kv_cache"] == w and 2 * s["kv_cache_bytes"] == fp32["kv_cache_bytes"], s
        explicit = plan("--weights", w, "--kv-cache", "fp32")
        assert explicit["plan"]["kv_cache"] is None and explicit["kv_cache_bytes"] == fp32["kv_cache_bytes"]
    assert plan("--weights", "fp16", "--kv-cache", "bf16")["plan"]["kv_cache"] == "bf16"
    assert plan("--weights", "int8")["plan"]["kv_cache"] is None
    assert fp32["plan"]["kv_cache"] is None


def test_format_names_round_trip():
    """Every format's canonical name (as plans and manifests store it) parses back to it: fp32,
    fp16 and two-level scales alike; names that are not canonical are refused."""
    from nxdc.weights.gguf_quant import KEPT, kept_format

    names = [weight_format.from_user(v).name for v in ("int8", "int8-row", "int4", "int4-sym", "int4-f32")]
    names += [kept_format(t).name for t in KEPT]
    assert {"int8-g32", "int8", "int4-asym-g32-f16", "int4-sym-g32-f16", "int4-asym-g32"} <= set(names)
    assert {"int4-asym-g32-k", "int8-g16-k", "int8-asym-g32-k", "int8-g32-f16"} <= set(names)
    for name in names:
        assert weight_format.parse(name).name == name
    for bad in ("int4-asym-g32-f32", "int4-g32", "int8-g48-k", "int4-asym-f16"):
        with pytest.raises(ValueError):
            weight_format.parse(bad)
    assert weight_format.from_user("int4-k").name == "int4-asym-g32-k"
    # nxdc's own quantizers write two-level scales under a -k name (uint8 [N, 2 * K/256 + K/G])
    got = stored_tensors("q.weight", torch.randn(4, 512), torch.uint8, "int4-asym-g32-k")
    assert got["q.scale"].dtype == torch.uint8 and got["q.scale"].shape == (4, 2 * 2 + 16)
    assert got["q.min"].shape == (4, 20)
