"""The decode graphs' integer ops (``nxdc::linear_q8`` / ``swiglu_q8``, kernels/decode_q8.cpp): on
a CPU with AVX-512 VNNI they equal an fp64 matmul of the int8-quantized activations (blocks of
32, one fp32 scale ``amax / 127`` each, round to nearest even) and the dequantised weights, up to
fp32 rounding (tests/test_kernels.py's bound), for int4 and grouped int8 in every group layout,
K tails and M in one and several passes; a row does not depend on the rows beside it (a verify
row equals a decode row); other group sizes, per-row int8 and CPUs without VNNI give the exact
ops' bits; bad arguments give the exact ops' errors; only decode / verify graphs of the coarse
formats call them (``--decode-matmul``'s option and key: test_prefill_kernels.py)."""

from __future__ import annotations

import pytest
import torch
from cpu_paths import NO_VNNI, VNNI, traced_code
from test_kernels import make  # (op arguments, dequantised weight) per format name

from nxdc.kernels import cpu_supported, ensure_loaded
from nxdc.model.layers import Linear, decode_matmuls

pytestmark = pytest.mark.skipif(not cpu_supported(), reason="CPU without AVX2/FMA: kernels are not used")


# every lanes-per-scale layout: 4 (i4 g32, i8 g16), 8 (i4 g64, i8 g32), 16 (i4 g128, i8 g64)
FORMATS = ["i4", "i4asym", "i4g64", "i4g128", "i8min", "i8g32", "i8g64"]
# (N, K): row-block tails, K with a partial last chunk (576 = 4.5 x 128), one of 16 int8 (48)
SHAPES = [(67, 576), (33, 1024), (5, 256), (16, 48)]
ROWS = [1, 2, 3, 4, 5, 8, 13]


def fits(fmt: str, k: int) -> bool:
    from test_kernels import GROUP

    return k % GROUP[fmt] == 0 and (not fmt.startswith("i4") or k % 32 == 0)


@pytest.fixture(scope="module", autouse=True)
def _loaded():
    assert ensure_loaded()


def exact(fmt: str):
    return torch.ops.nxdc.linear_i4 if fmt.startswith("i4") else torch.ops.nxdc.linear_i8


def q8(x: torch.Tensor) -> torch.Tensor:
    """The activations the kernel multiplies: per row, blocks of 32 rounded to int8 in fp32 ops."""
    out = torch.empty_like(x)
    for k0 in range(0, x.shape[1], 32):
        b = x[:, k0 : k0 + 32]
        amax = b.abs().amax(1, keepdim=True)
        inv = torch.where(amax > 0, 127 / amax, torch.zeros_like(amax))
        out[:, k0 : k0 + 32] = torch.round(b * inv) * (amax / 127)
    return out


def check(got: torch.Tensor, x: torch.Tensor, wd: torch.Tensor) -> None:
    """|got - ref| <= 1e-6 sqrt(K) (|q8(x)| @ |w|^T), ref the fp64 product of q8(x) and w."""
    assert got.dtype == torch.float32 and got.shape == (x.shape[0], wd.shape[0])
    xq, w = q8(x).double(), wd.double()
    bound = 1e-6 * x.shape[1] ** 0.5 * (xq.abs() @ w.abs().t()) + 1e-30
    err = (got.double() - xq @ w.t()).abs()
    assert bool((err <= bound).all()), f"max err/bound {(err / bound).max().item():.3g}"


@pytest.mark.skipif(not VNNI, reason=NO_VNNI)
@pytest.mark.parametrize("fmt, n, k", [(f, n, k) for f in FORMATS for n, k in SHAPES if fits(f, k)])
@pytest.mark.parametrize("rows", ROWS)
def test_integer_ops_equal_the_quantized_reference(fmt, rows, n, k):
    torch.manual_seed(rows * 131 + n * 7 + k)
    x = torch.randn(rows, k)
    x[0, :32] = 0  # an all-zero block (scale 0)
    args, wd = make(fmt, torch.randn(n, k))
    check(torch.ops.nxdc.linear_q8(x, *args), x, wd)
    if n % 2 == 0:  # swiglu: gate rows then up rows
        h = n // 2
        ref = torch.ops.nxdc.linear_q8(x, *args)
        want = torch.nn.functional.silu(ref[:, :h]) * ref[:, h:]
        torch.testing.assert_close(torch.ops.nxdc.swiglu_q8(x, *args), want, rtol=2e-6, atol=1e-6)


@pytest.mark.skipif(not VNNI, reason=NO_VNNI)
@pytest.mark.parametrize("fmt", FORMATS)
def test_a_row_does_not_depend_on_the_rows_beside_it(fmt):
    torch.manual_seed(3)
    x = torch.randn(13, 1024)
    args, _ = make(fmt, torch.randn(40, 1024))
    ops = torch.ops.nxdc
    all_rows = ops.linear_q8(x, *args)
    assert not torch.equal(all_rows, exact(fmt)(x, *args))  # the integer path really ran
    for i in (0, 4, 12):
        assert torch.equal(ops.linear_q8(x[i : i + 1], *args)[0], all_rows[i])
        assert torch.equal(ops.linear_q8(x[i : i + 5], *args)[0], all_rows[i]) if i + 5 <= 13 else True
    assert torch.equal(ops.swiglu_q8(x[4:5], *args)[0], ops.swiglu_q8(x, *args)[4])


@pytest.mark.parametrize(
    "fmt, group",
    [("i4", 96), ("i8", None)],  # a group size with no lane layout; int8 with one scale a row
)
def test_other_layouts_take_the_exact_kernels(fmt, group):
    from nxdc.model.quant import quantize_int4, quantize_int8

    torch.manual_seed(4)
    x, w = torch.randn(3, 192), torch.randn(20, 192)
    args = quantize_int4(w, group)[:2] if fmt == "i4" else quantize_int8(w, group)
    assert torch.equal(torch.ops.nxdc.linear_q8(x, *args), exact(fmt)(x, *args))
    assert torch.equal(torch.ops.nxdc.swiglu_q8(x, *args), torch.ops.nxdc.swiglu(x, *args))


@pytest.mark.parametrize(
    "args, message",
    [
        (
            (torch.randn(2, 64), torch.zeros(8, 32, dtype=torch.uint8), torch.ones(8, 1), torch.ones(8, 2)),
            "min",
        ),
        (
            (torch.randn(2, 64), torch.zeros(8, 16, dtype=torch.uint8), torch.ones(8, 2)),
            "x has K=64 but w has K=32",
        ),
        ((torch.randn(2, 64), torch.zeros(8, 64), torch.ones(8, 2)), "must be int8 or int4"),
        (
            (torch.randn(2, 64).double(), torch.zeros(8, 64, dtype=torch.int8), torch.ones(8, 2)),
            "x must be float32",
        ),
    ],
)
def test_bad_arguments_raise_the_exact_ops_errors(args, message):
    with pytest.raises(RuntimeError, match=message):
        torch.ops.nxdc.linear_q8(*args)


@pytest.mark.parametrize(
    "stored, integer",
    [
        ("int4-asym-g32", True),
        ("int4-asym-g32-f16", True),  # --weights int4, a kept Q4_1
        ("int4-sym-g64", True),
        ("int8-asym-g16", True),  # a kept Q6_K / Q5_K
        ("int8-g32", True),  # --weights int8, a kept Q8_0 / Q6_K
        ("int8", True),  # per row: the op keeps the exact products (no lanes for it)
        ("bf16", False),
        (None, False),
    ],
)
def test_only_decode_graphs_of_integer_formats_call_the_integer_ops(stored, integer):
    lin = Linear(64, 32, bias=False, dtype=torch.float32, kernels=True)
    torch.nn.init.normal_(lin.weight)
    if stored:
        lin.store_as(stored)
    x = torch.randn(2, 1, 64)
    assert ("nxdc.linear_q8" in traced_code(lin, x, decode_matmuls())) == integer
    assert "nxdc.linear_q8" not in traced_code(lin, x)
