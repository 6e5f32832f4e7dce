"""The prefill graphs' linear ops (``nxdc::prefill_linear`` / ``prefill_swiglu``,
kernels/prefill.cpp): on a CPU with AMX they equal an fp64 matmul of the bf16-rounded
activations and bf16-rounded dequantised weights up to fp32 accumulation rounding (same bound as
tests/test_kernels.py), for tail tiles in N, several K blocks and M past one micro-kernel call;
rows do not depend on the rows beside them; other formats, CPUs and small M give the exact ops'
bits; only the prefill graphs call them. Also: the dequantised weights the kernels multiply by
are the reference's bits (no FMA contraction of q * s + m)."""

from __future__ import annotations

import pytest
import torch
from cpu_paths import NO_TILES, TILES, traced_code
from test_kernels import make  # (op arguments, dequantised weight) per format name

from nxdc.kernels import cpu_supported, ensure_loaded
from nxdc.model.layers import Linear, prefill_matmuls

pytestmark = pytest.mark.skipif(not cpu_supported(), reason="CPU without AVX2/FMA: kernels are not used")


FORMATS = ["bf16", "i8", "i8g32", "i8min", "i4", "i4asym", "i4g64"]
# (N, K): a partial last tile of 64 rows, K in 5 blocks of 832 (4160 = 5 x 832), SmolLM2's K
SHAPES = [(70, 192), (200, 4160), (17, 576), (64, 2048)]


@pytest.fixture(scope="module", autouse=True)
def _loaded():
    assert ensure_loaded()


def exact(fmt: str):
    ops = torch.ops.nxdc
    return ops.linear_bf16 if fmt == "bf16" else ops.linear_i4 if fmt.startswith("i4") else ops.linear_i8


# int8 with one scale (no mins) and bf16 weights take fp32 activations as two bf16 parts (hi + lo:
# x within 2^-17)
SPLIT = {"i8", "i8g32", "bf16"}


def check(got: torch.Tensor, x: torch.Tensor, wd: torch.Tensor, fmt: str) -> None:
    """|got - ref| <= 1e-6 sqrt(K) (|x| @ |w|^T), ref the fp64 product of the bf16-rounded
    operands; for SPLIT formats of fp32 x and the bf16-rounded weights, within 2^-16 more."""
    split = fmt in SPLIT
    xb, wb = (x.double() if split else x.bfloat16().double()), wd.bfloat16().double()
    ref = xb @ wb.t()
    bound = (1e-6 * x.shape[1] ** 0.5 + (2**-16 if split else 0)) * (xb.abs() @ wb.abs().t()) + 1e-30
    err = (got.double() - ref).abs()
    assert bool((err <= bound).all()), f"max err/bound {(err / bound).max().item():.3g}"
    if split:  # and really closer than one bf16 rounding of x: a single-part product misses the bound
        one = (x.bfloat16().double() @ wb.t() - ref).abs()
        assert bool((one > bound).any())


@pytest.mark.skipif(not TILES, reason=NO_TILES)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("n, k", SHAPES)
@pytest.mark.parametrize("rows", [16, 130])
def test_tiles_match_bf16_reference(fmt, n, k, rows):
    torch.manual_seed(rows * 7 + n * 31 + k)
    x, w = torch.randn(rows, k), torch.randn(n, k)
    args, wd = make(fmt, w)
    got = torch.ops.nxdc.prefill_linear(x, *args)
    assert got.shape == (rows, n) and got.dtype == torch.float32
    check(got, x, wd, fmt)
    if n % 2 == 0:
        sw = torch.ops.nxdc.prefill_swiglu(x, *args)
        gate, up = torch.ops.nxdc.prefill_linear(x, *args).chunk(2, dim=1)
        torch.testing.assert_close(sw, torch.nn.functional.silu(gate) * up, rtol=1e-6, atol=1e-6)


@pytest.mark.skipif(not TILES, reason=NO_TILES)
@pytest.mark.parametrize("fmt", FORMATS)
def test_tile_rows_do_not_depend_on_the_rows_beside_them(fmt):
    torch.manual_seed(3)
    x, w = torch.randn(130, 832), torch.randn(96, 832)
    args, _ = make(fmt, w)
    full = torch.ops.nxdc.prefill_linear(x, *args)
    assert torch.equal(torch.ops.nxdc.prefill_linear(x[100:116].contiguous(), *args), full[100:116])
    assert torch.equal(torch.ops.nxdc.prefill_linear(x[:16].contiguous(), *args), full[:16])


@pytest.mark.skipif(not TILES, reason=NO_TILES)
def test_tiles_are_taken_where_the_cpu_has_them():
    """Activations as two bf16 parts: the tile path's result differs from the exact kernel's."""
    torch.manual_seed(7)
    x, w = torch.randn(16, 64), torch.randn(8, 64).bfloat16()
    got = torch.ops.nxdc.prefill_linear(x, w)
    assert not torch.equal(got, torch.ops.nxdc.linear_bf16(x, w))
    check(got, x, w.float(), "bf16")


@pytest.mark.skipif(not TILES, reason=NO_TILES)
def test_bf16_activations_on_bf16_weights_take_one_part():
    """x whose values are bf16 already (``--dtype bf16``) on bf16 weights: the second part is all
    zero and its pass is skipped, which gives the bits the pass would (a row's result does not
    depend on whether the rows beside it have a second part), within the one-part bound."""
    torch.manual_seed(8)
    w = torch.randn(96, 832).bfloat16()
    x = torch.randn(40, 832)
    x[:24] = x[:24].bfloat16().float()  # rows 0..23 bf16-valued, 24..39 not
    full = torch.ops.nxdc.prefill_linear(x, w)
    head = torch.ops.nxdc.prefill_linear(x[:24].contiguous(), w)
    assert torch.equal(head, full[:24])
    ref = x[:24].double() @ w.double().t()
    bound = 1e-6 * 832**0.5 * (x[:24].double().abs() @ w.double().abs().t()) + 1e-30
    assert bool(((head.double() - ref).abs() <= bound).all())


@pytest.mark.parametrize("fmt", FORMATS)
def test_few_rows_take_the_exact_kernels(fmt):
    torch.manual_seed(4)
    x, w = torch.randn(15, 192), torch.randn(40, 192)
    args, _ = make(fmt, w)
    assert torch.equal(torch.ops.nxdc.prefill_linear(x, *args), exact(fmt)(x, *args))
    assert torch.equal(torch.ops.nxdc.prefill_swiglu(x, *args), torch.ops.nxdc.swiglu(x, *args))


@pytest.mark.parametrize("fmt", ["bf16", "i8"])
def test_empty_sizes_as_the_exact_kernels(fmt):
    ops = torch.ops.nxdc
    for m, n, k in [(32, 8, 0), (32, 0, 64), (0, 8, 64)]:
        w = torch.zeros(n, k, dtype=torch.bfloat16 if fmt == "bf16" else torch.int8)
        extra = () if fmt == "bf16" else (torch.ones(n),)
        got = ops.prefill_linear(torch.randn(m, k), w, *extra)
        assert got.shape == (m, n) and bool((got == 0).all())


def test_fp32_and_fp16_weights_take_the_exact_kernels():
    torch.manual_seed(5)
    x, w = torch.randn(40, 96), torch.randn(24, 96)
    ops = torch.ops.nxdc
    assert torch.equal(ops.prefill_linear(x, w), ops.linear_f32(x, w))
    assert torch.equal(ops.prefill_linear(x, w.half()), ops.linear_f16(x, w.half()))
    assert torch.equal(ops.prefill_swiglu(x, w), ops.swiglu(x, w))


@pytest.mark.parametrize(
    "args, message",
    [
        ((torch.randn(32, 64), torch.zeros(8, 64, dtype=torch.int8)), "int8 weights take a scale"),
        ((torch.randn(32, 64), torch.zeros(8, 32, dtype=torch.bfloat16)), "x has K=64 but w has K=32"),
        ((torch.randn(32, 64), torch.zeros(8, 32, dtype=torch.uint8), torch.ones(8)), "need group scales"),
    ],
)
def test_bad_arguments_raise_the_exact_ops_errors(args, message):
    with pytest.raises(RuntimeError, match=message):
        torch.ops.nxdc.prefill_linear(*args)


@pytest.mark.parametrize(
    "dtype, stored, tiled",
    [  # tiled: by --prefill-matmul tiles (the default), by tiles-int8
        (torch.float32, "int4-asym-g32", (True, True)),
        (torch.float32, "int4-asym-g32-f16", (True, True)),  # --weights int4, a kept Q4_1
        (torch.float32, "int4-sym-g64", (True, True)),
        (torch.bfloat16, None, (True, True)),  # --dtype bf16
        (torch.float32, None, (False, False)),
        (torch.float32, "bf16", (True, True)),  # --weights bf16: fp32 activations as two bf16 parts
        (torch.float32, "int8-g32", (False, True)),  # --weights int8
        (torch.float32, "int8-g32-f16", (False, True)),  # a kept Q8_0
        (torch.float32, "int8", (False, True)),  # --weights int8-row
        (torch.float32, "int8-asym-g16", (True, True)),  # a kept Q6_K / Q5_K
        (torch.float32, "fp16", (False, False)),
    ],
)
def test_only_prefill_graphs_call_the_tile_ops(dtype, stored, tiled):
    lin = Linear(64, 32, bias=False, dtype=dtype, kernels=True)
    torch.nn.init.normal_(lin.weight)
    if stored:
        lin.store_as(stored)
    x = torch.randn(2, 20, 64, dtype=dtype)
    for mode, want in zip(("tiles", "tiles-int8"), tiled, strict=True):
        assert ("nxdc.prefill_linear" in traced_code(lin, x, prefill_matmuls(mode))) == want, mode
    assert "nxdc.prefill_linear" not in traced_code(lin, x, prefill_matmuls("exact"))
    assert "nxdc.prefill_linear" not in traced_code(lin, x)


@pytest.mark.parametrize("fmt", ["i8min", "i4asym"])
def test_kernels_multiply_by_the_reference_dequantisation(fmt):
    """x = I reads the weights back: q * s + m rounded twice, as the reference does (a contracted
    FMA rounds once and differs in ~25% of the weights)."""
    torch.manual_seed(6)
    k = 256
    args, wd = make(fmt, torch.randn(48, k))
    eye = torch.eye(k)
    assert torch.equal(exact(fmt)(eye, *args).t(), wd)
    if TILES:
        assert torch.equal(torch.ops.nxdc.prefill_linear(eye, *args).t(), wd.bfloat16().float())


PROMPT_GRAPHS, STEP_GRAPHS = (("context", 64), ("chunk", 32)), (("decode", 64), ("verify", 64))


@pytest.mark.parametrize(
    "name, values, bad, keyed, shared",
    [
        ("prefill_matmul", ("tiles", "exact", "tiles-int8"), "fast", PROMPT_GRAPHS, STEP_GRAPHS),
        ("decode_matmul", ("exact", "int8"), "int4", STEP_GRAPHS, PROMPT_GRAPHS),
    ],
)
def test_matmul_options_key_only_their_graphs(tiny_gqa, tmp_path, name, values, bad, keyed, shared):
    """``--prefill-matmul`` (tiles by default) and ``--decode-matmul`` (exact by default): the
    other values on request, anything else refused in one line; each names only its own graphs'
    cache entries (prompt graphs; decode and verify graphs), so exports differing in one share
    the other graphs."""
    import json

    from typer.testing import CliRunner

    from nxdc.archs import spec_from_config
    from nxdc.buckets import Bucket
    from nxdc.cli.main import app
    from nxdc.compile.backends.registry import get_backend
    from nxdc.compile.graph_keys import key_parts
    from nxdc.compile.planning import make_plan
    from nxdc.plan import ExportOptions

    flag = "--" + name.replace("_", "-")
    r = CliRunner()
    dry = ["export", str(tiny_gqa), "-o", str(tmp_path / "x"), "--dry-run", "--json"]
    default, others = values[0], values[1:]
    assert json.loads(r.invoke(app, dry).stdout)["plan"][name] == default
    for other in others:
        res = r.invoke(app, [*dry, flag, other])
        assert res.exit_code == 0 and json.loads(res.stdout)["plan"][name] == other
    res = r.invoke(app, [*dry, flag, bad])
    assert res.exit_code == 2 and f"{flag} must be one of {', '.join(values)} (got '{bad}')" in res.output

    spec = spec_from_config(json.loads((tiny_gqa / "config.json").read_text()))
    backend = get_backend("inductor", "cpu")

    def key(value, bucket):
        plan = make_plan(spec, ExportOptions(weights="int4", **{name: value}))
        return json.dumps(key_parts(spec, plan, Bucket(*bucket), backend, "k"), sort_keys=True)

    for other in others:
        for bucket in shared:
            assert key(default, bucket) == key(other, bucket)
        for bucket in keyed:
            assert key(default, bucket) != key(other, bucket)
