"""nxdc's linear kernels (``nxdc::linear_f32 / linear_f16 / linear_bf16 / linear_i8``) equal an
fp64 matmul of the (dequantised) weights up to fp32 accumulation rounding, for every row count
(one streaming pass for M <= 8, tiled passes beyond; at::mm / blocked dequantise + at::mm for
M > 32 on the AVX2 path), odd K and N, both the AVX-512 and the AVX2 code paths; each output row
is bit-identical whatever the number of rows beside it (what makes greedy speculation exact);
they survive torch.export + AOTInductor bit for bit; int8 quantisation is round-to-nearest.

Tolerance: |got - ref| <= 1e-6 * sqrt(K) * (|x| @ |w|^T) elementwise, i.e. a relative error
of ~8 fp32 ulps * sqrt(K) of the sum of absolute products (the kernels sit ~10x inside it)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

from nxdc.kernels import cpu_supported, ensure_loaded
from nxdc.model.quant import (
    SCALE_STEPS,
    dequantize_int4,
    dequantize_int8,
    group_values,
    pack_int4,
    quantize_int4,
    quantize_int8,
    unpack_int4,
)

needs_kernels = pytest.mark.skipif(not cpu_supported(), reason="CPU without AVX2/FMA: kernels are not used")
pytestmark = needs_kernels

ROWS = [1, 2, 3, 4, 5, 6, 7, 8, 9, 13, 20, 64]
SHAPES = [(1, 16), (7, 100), (67, 576), (192, 576), (576, 1536), (33, 1000)]  # (N, K)
FORMATS = ["f32", "f16", "bf16", "i8", "i8g32", "i8min", "i4", "i4asym", "i4g64", "i4asym-h", "i8g32-h"]
# inputs per scale group (K must be a multiple); i8min: int8 with a min per group (GGUF Q5_K's form);
# -h: the group scales (and mins) stored as fp16 (--weights int4's default)
GROUP = {"i8g32": 32, "i8g64": 64, "i8min": 16, "i4": 32, "i4asym": 32, "i4g64": 64, "i4g128": 128}
GROUP.update({f"{f}-h": GROUP[f] for f in ("i4asym", "i8g32")})


def fits(fmt: str, k: int) -> bool:
    return k % GROUP.get(fmt, 1) == 0


@pytest.fixture(scope="module", autouse=True)
def _loaded():
    assert ensure_loaded()


def make(fmt: str, w: torch.Tensor) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """(op arguments after x, fp32 dequantised weight the op must match)."""
    if fmt == "f32":
        return (w,), w
    if fmt == "f16":
        wq = w.to(torch.float16)
        return (wq,), wq.float()
    if fmt == "bf16":
        wq = w.to(torch.bfloat16)
        return (wq,), wq.float()
    scales = "f16" if fmt.endswith("-h") else "f32"
    if fmt.startswith("i4"):
        p, s, m = quantize_int4(w, GROUP[fmt], asymmetric=fmt.startswith("i4asym"), scales=scales)
        return ((p, s) if m is None else (p, s, m)), dequantize_int4(p, s, m)
    q, s = quantize_int8(w, GROUP.get(fmt), scales=scales)
    if fmt == "i8min":
        m = torch.randn_like(s) * s  # any min: w = q * s + m
        return (q, s, m), dequantize_int8(q, s, m)
    return (q, s), dequantize_int8(q, s)


def op(fmt: str):
    ops = torch.ops.nxdc
    return {"f32": ops.linear_f32, "f16": ops.linear_f16, "bf16": ops.linear_bf16}.get(
        fmt, ops.linear_i4 if fmt.startswith("i4") else ops.linear_i8
    )


def check(got: torch.Tensor, x: torch.Tensor, wd: torch.Tensor) -> None:
    assert got.dtype == torch.float32 and got.shape == (x.shape[0], wd.shape[0])
    ref = x.double() @ wd.double().t()
    bound = 1e-6 * x.shape[1] ** 0.5 * (x.double().abs() @ wd.double().abs().t()) + 1e-30
    err = (got.double() - ref).abs()
    assert bool((err <= bound).all()), f"max err/bound {(err / bound).max().item():.3g}"


@pytest.mark.parametrize("fmt, n, k", [(f, n, k) for f in FORMATS for n, k in SHAPES if fits(f, k)])
@pytest.mark.parametrize("rows", ROWS)
def test_matches_dequantised_reference(fmt, rows, n, k):
    torch.manual_seed(rows * 7919 + n * 31 + k)
    x, w = torch.randn(rows, k), torch.randn(n, k)
    args, wd = make(fmt, w)
    check(op(fmt)(x, *args), x, wd)


@pytest.mark.parametrize("fmt", FORMATS)
def test_rows_are_independent_of_the_batch(fmt):
    """Row i of an M-row call equals the 1-row call on x[i] bit for bit, for every M: a verify
    graph (B * (k + 1) rows) then scores a token exactly as a decode step (B rows) does."""
    torch.manual_seed(6)
    for n, k in ((67, 576), (300, 96), (576, 1536)):
        if not fits(fmt, k):
            continue
        w = torch.randn(n, k)
        args, _ = make(fmt, w)
        x = torch.randn(64, k)
        alone = torch.cat([op(fmt)(x[i : i + 1], *args) for i in range(64)])
        for rows in (2, 3, 4, 5, 6, 7, 8, 9, 13, 16, 20, 64):
            assert torch.equal(op(fmt)(x[:rows], *args), alone[:rows]), (n, k, rows)


def swiglu_reference(x: torch.Tensor, wd: torch.Tensor) -> torch.Tensor:
    full = x.double() @ wd.double().t()
    i = wd.shape[0] // 2
    return F.silu(full[:, :i]) * full[:, i:]


@pytest.mark.parametrize(
    "fmt, i, k",
    [(f, i, k) for f in FORMATS for i, k in ((1536, 576), (40, 100), (7, 64), (1, 16)) if fits(f, k)],
)
def test_swiglu_matches_reference(fmt, i, k):
    """``nxdc::swiglu(x, [gate; up])`` = silu(x @ gate^T) * (x @ up^T): the kernel's gate and up
    sums are the linear op's bit for bit, and its SiLU is within a few fp32 ulps of an fp64 one."""
    torch.manual_seed(i + k)
    w = torch.randn(2 * i, k) * 0.2
    args, wd = make(fmt, w)
    for rows in (1, 3, 8, 9, 40):
        x = torch.randn(rows, k)
        got = torch.ops.nxdc.swiglu(x, *args)
        assert got.shape == (rows, i) and got.dtype == torch.float32
        lin = op(fmt)(x, *args)  # the same sums, then SiLU in fp64
        ref = F.silu(lin[:, :i].double()) * lin[:, i:].double()
        assert bool(((got.double() - ref).abs() <= 4e-7 * ref.abs() + 1e-30).all()), fmt
        check_close = (got.double() - swiglu_reference(x, wd)).abs().max().item()
        bound = 1e-6 * k**0.5 * (x.double().abs() @ wd.double().abs().t()).max().item()
        assert check_close <= bound, (check_close, bound)


@pytest.mark.parametrize("fmt", FORMATS)
def test_swiglu_rows_are_independent_of_the_batch(fmt):
    torch.manual_seed(8)
    w = torch.randn(2 * 1536, 576) * 0.1
    args, _ = make(fmt, w)
    x = torch.randn(40, 576)
    alone = torch.cat([torch.ops.nxdc.swiglu(x[i : i + 1], *args) for i in range(40)])
    for rows in (2, 5, 8, 9, 16, 40):
        assert torch.equal(torch.ops.nxdc.swiglu(x[:rows], *args), alone[:rows]), rows


def test_swiglu_extreme_inputs():
    """Large |gate| neither overflows nor loses the sign: silu(g) -> g for g >> 0, -> -0 for g << 0."""
    x = torch.tensor([[1.0]])
    g = torch.tensor([0.0, 1.0, -1.0, 20.0, -20.0, 88.0, -88.0, 100.0, -100.0, 1e30, -1e30, 3.0e38, -3.0e38])
    w = torch.cat([g, torch.ones_like(g)]).unsqueeze(1)  # gate rows g, up rows 1: out = silu(g)
    got = torch.ops.nxdc.swiglu(x, w, None)[0]
    ref = F.silu(g.double())
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.double(), ref, rtol=1e-6, atol=1e-30)


def test_swiglu_bad_arguments_raise():
    x = torch.randn(2, 64)
    with pytest.raises(RuntimeError, match="stack gate and up"):
        torch.ops.nxdc.swiglu(x, torch.randn(3, 64), None)
    with pytest.raises(RuntimeError, match="int8 / int4 weights take a scale"):
        torch.ops.nxdc.swiglu(x, torch.zeros(4, 64, dtype=torch.int8), None)
    with pytest.raises(RuntimeError, match="int8 / int4 weights take a scale"):
        torch.ops.nxdc.swiglu(x, torch.randn(4, 64), torch.ones(4))
    with pytest.raises(RuntimeError, match="only int8 / int4 weights take a min"):
        torch.ops.nxdc.swiglu(x, torch.randn(4, 64), None, torch.ones(4, 2))
    with pytest.raises(RuntimeError, match="must be float32, float16, bfloat16, int8 or int4"):
        torch.ops.nxdc.swiglu(x, torch.randn(4, 64).double(), None)
    with pytest.raises(RuntimeError, match="K=64 but w has K=63"):
        torch.ops.nxdc.swiglu(x, torch.randn(4, 63), None)


@pytest.mark.parametrize("fmt", FORMATS)
def test_lm_head_sized(fmt):
    torch.manual_seed(1)
    w = torch.randn(49152 + 7, 576) * 0.05
    args, wd = make(fmt, w)
    for rows in (1, 8):
        x = torch.randn(rows, 576)
        check(op(fmt)(x, *args), x, wd)


@pytest.mark.parametrize("fmt", [f for f in FORMATS if fits(f, 96)])
def test_non_contiguous_inputs(fmt):
    torch.manual_seed(2)
    x = torch.randn(96, 4).t()  # [4, 96], strides (1, 4)
    w = torch.randn(2 * 40, 96)
    args, wd = make(fmt, w)
    args = tuple(a[::2] for a in args)  # every other weight row (and its scale)
    check(op(fmt)(x, *args), x, wd[::2])


def test_group_scales_other_group_sizes():
    torch.manual_seed(3)
    x, w = torch.randn(3, 576), torch.randn(40, 576)
    for g in (16, 48, 64, 192, 576):
        q, s = quantize_int8(w, g)
        assert s.shape == (40, 576 // g)
        check(torch.ops.nxdc.linear_i8(x, q, s), x, dequantize_int8(q, s))


def test_empty_sizes():
    x = torch.randn(2, 0)
    assert torch.equal(
        torch.ops.nxdc.linear_f16(x, torch.empty(5, 0, dtype=torch.float16)), torch.zeros(2, 5)
    )
    assert torch.ops.nxdc.linear_bf16(torch.randn(0, 8), torch.randn(5, 8).bfloat16()).shape == (0, 5)
    q, s = quantize_int8(torch.randn(0, 32))
    assert torch.ops.nxdc.linear_i8(torch.randn(3, 32), q, s).shape == (3, 0)


def test_bad_arguments_raise():
    x = torch.randn(2, 64)
    with pytest.raises(RuntimeError, match="must be float32"):
        torch.ops.nxdc.linear_f32(x, torch.randn(3, 64).half())
    with pytest.raises(RuntimeError, match="must be float16"):
        torch.ops.nxdc.linear_f16(x, torch.randn(3, 64))
    with pytest.raises(RuntimeError, match="must be bfloat16"):
        torch.ops.nxdc.linear_bf16(x, torch.randn(3, 64).half())
    with pytest.raises(RuntimeError, match="x must be float32"):
        torch.ops.nxdc.linear_f16(x.double(), torch.randn(3, 64).half())
    with pytest.raises(RuntimeError, match="K=64 but w has K=63"):
        torch.ops.nxdc.linear_f16(x, torch.randn(3, 63).half())
    q, s = quantize_int8(torch.randn(3, 64))
    with pytest.raises(RuntimeError, match="must be int8"):
        torch.ops.nxdc.linear_i8(x, q.to(torch.uint8), s)
    with pytest.raises(RuntimeError, match="scale has 2 rows"):
        torch.ops.nxdc.linear_i8(x, q, s[:2])
    with pytest.raises(RuntimeError, match="multiple of 16"):
        torch.ops.nxdc.linear_i8(x, q, torch.ones(3, 8))  # groups of 8
    with pytest.raises(RuntimeError, match="scale must be a float32"):
        torch.ops.nxdc.linear_i8(x, q, s.double())
    p, s4, _ = quantize_int4(torch.randn(3, 64))
    with pytest.raises(RuntimeError, match="must be uint8"):
        torch.ops.nxdc.linear_i4(x, p.to(torch.int8), s4)
    with pytest.raises(RuntimeError, match="K=64 but w has K=62"):
        torch.ops.nxdc.linear_i4(x, p[:, :31], s4)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        torch.ops.nxdc.linear_i4(x, p, torch.ones(3, 4))  # groups of 16: half a packed block
    with pytest.raises(RuntimeError, match="need group scales"):
        torch.ops.nxdc.linear_i4(x, p, torch.ones(3))
    with pytest.raises(RuntimeError, match="min must be a CPU tensor of scale's dtype and shape"):
        torch.ops.nxdc.linear_i4(x, p, s4, torch.ones(3, 1))
    with pytest.raises(RuntimeError, match="min must be a CPU tensor of scale's dtype and shape"):
        torch.ops.nxdc.linear_i4(x, p, s4.half(), torch.ones(3, 2))  # fp16 scales, fp32 mins
    with pytest.raises(RuntimeError, match="group scales: float32 or float16"):
        torch.ops.nxdc.linear_i8(x, q, s.half())  # per-row scales stay fp32


def _two_level(n: int, k: int, group: int, signed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Random group values as a K-quant stores them (an fp16 per 256 weights times an int8 per
    group): (the two-level layout, the fp32 values)."""
    from nxdc.weights.gguf_quant import k_factors

    d = (torch.rand(n, k // 256, 1) * 0.01 + 1e-4).half().float()
    c = torch.randint(-128 if signed else 0, 128 if signed else 64, (n, k // 256, 256 // group)).float()
    v = (d * c).reshape(n, k // group)
    return k_factors(v, 256 // group), v


@pytest.mark.parametrize(
    "storage, k", [("f16", 160), ("f16", 576), ("f16", 1024), ("k", 256), ("k", 1024), ("k", 2304)]
)  # f16: 5, 18 and 32 groups a row (the conversion's tails); k: 1, 4 and 9 super-blocks
def test_stored_scales_equal_their_fp32_values(storage, k):
    """Every op that takes int8 / int4 weights gives, with fp16 or two-level (GGUF K-quant) group
    scales and mins, exactly what it gives with the same values in fp32 (the kernels expand a
    row's scales exactly): exact, integer (decode) and tile (prefill) paths, linear and SwiGLU,
    1 to 40 rows."""
    torch.manual_seed(k)
    ops = torch.ops.nxdc
    w = torch.randn(48, k)
    if storage == "f16":
        cases = [quantize_int4(w, 32, True, "f16"), quantize_int4(w, 32, False, "f16")]
        cases.append((*quantize_int8(w, 32, "f16"), None))
        cases = [(q, s, m, s.float(), None if m is None else m.float()) for q, s, m in cases]
    else:  # Q4_K (int4 + min, g32), Q6_K (int8 sym, g16), Q4_K + Q6_K fused (int8 + min, g16)
        s4, s4v = _two_level(48, k, 32, False)
        m4, m4v = _two_level(48, k, 32, True)
        s8, s8v = _two_level(48, k, 16, True)
        m8, m8v = _two_level(48, k, 16, True)
        q4 = pack_int4(torch.randint(0, 16, (48, k)))
        q8 = torch.randint(-128, 128, (48, k), dtype=torch.int8)
        cases = [(q4, s4, m4, s4v, m4v), (q8, s8, None, s8v, None), (q8, s8, m8, s8v, m8v)]
        # nxdc's own two-level quantizers (--weights int4-k and its kin)
        own = [quantize_int4(w, 32, True, "k"), quantize_int4(w, 64, False, "k")]
        own.append((*quantize_int8(w, 32, "k"), None))
        for q, sc, m in own:
            cases.append((q, sc, m, group_values(sc, k), None if m is None else group_values(m, k)))
        assert torch.equal(dequantize_int4(q4, s4, m4), dequantize_int4(q4, s4v, m4v))
        assert torch.equal(dequantize_int8(q8, s8, m8), dequantize_int8(q8, s8v, m8v))
    for rows in (1, 3, 9, 40):
        x = torch.randn(rows, k)
        for q, s, m, s32, m32 in cases:
            assert s.dtype == (torch.float16 if storage == "f16" else torch.uint8)
            tail = () if m is None else (m,)
            tail32 = () if m is None else (m32,)
            s32 = s32.contiguous()
            for name in ("linear_q8", "prefill_linear", "swiglu_q8", "prefill_swiglu", "swiglu"):
                f = getattr(ops, name)
                assert torch.equal(f(x, q, s, *tail), f(x, q, s32, *tail32)), (name, rows, q.dtype)
            f = ops.linear_i4 if q.dtype == torch.uint8 else ops.linear_i8
            assert torch.equal(f(x, q, s, *tail), f(x, q, s32, *tail32)), (rows, q.dtype)


def test_quantize_int4_round_trip():
    """Packing is the kernels' block order, the error is within half a step, both forms use their
    whole range, and a bad group is refused in one line."""
    torch.manual_seed(9)
    nib = torch.randint(0, 16, (5, 64))
    packed = pack_int4(nib)
    assert packed.shape == (5, 32) and torch.equal(unpack_int4(packed), nib.to(torch.uint8))
    assert int(packed[0, 0]) == int(nib[0, 0]) | (int(nib[0, 16]) << 4)  # byte j: weights j, 16 + j
    w = torch.randn(37, 576) * torch.rand(37, 1) * 3
    w[3] = 0.0
    for g, asym in ((32, False), (32, True), (64, False), (192, True)):
        p, s, m = quantize_int4(w, g, asym)
        assert p.dtype == torch.uint8 and s.shape == (37, 576 // g) and (m is not None) == asym
        err = (dequantize_int4(p, s, m).double() - w.double()).abs()
        step = s.abs().repeat_interleave(g, dim=1).double()
        # half a step; symmetric (Q4_0's scale): a whole one at the clamped end (+8 -> +7)
        assert bool((err <= step * (0.5 if asym else 1.0) * (1 + 1e-5) + 1e-12).all()), (g, asym)
        assert float(dequantize_int4(p, s, m)[3].abs().max()) == 0.0  # an all-zero row stays zero
        nib = unpack_int4(p).reshape(37, -1, g)
        # every non-zero group reaches a range end: 0 (-8 symmetric) and, asymmetric, also 15
        assert bool((nib.amin(-1) == 0)[s != 0].all())
        if asym:
            assert bool((nib.amax(-1) == 15)[s != 0].all())
    for bad in (16, 48, 100):
        with pytest.raises(ValueError, match="multiple of 32"):
            quantize_int4(torch.randn(4, 96), bad)


@pytest.mark.parametrize("asym", [True, False], ids=["asym", "sym"])
def test_two_level_quantization_clips_nothing(asym):
    """``scales="k"`` (``--weights int4-k``): each super-block's fp16 ``d`` covers its largest
    value in 127 steps, a scale rounds away from zero and a min down, so every weight stays
    within half a step of its level (asymmetric; symmetric: a whole step at the clamped end), as
    with fp32 scales; the rms error moves by under 3% on Gaussian weights; a K that super-blocks
    do not divide is refused."""
    torch.manual_seed(11)
    w = torch.randn(64, 1024) * torch.rand(64, 1) * 0.05
    w[:, ::97] *= 8  # outliers widen some groups
    w[5] = 0.0
    w[6, :256] = 0.0  # an all-zero super-block
    p, s, m = quantize_int4(w, 32, asym, "k")
    assert s.dtype == torch.uint8 and s.shape == (64, 2 * 4 + 32) and (m is not None) == asym
    sv = group_values(s, 1024)
    back = dequantize_int4(p, s, m)
    err = (back.double() - w.double()).abs().reshape(64, 32, 32)
    step = sv.abs().double().unsqueeze(-1)
    assert bool((err <= step * (0.5 if asym else 1.0) * (1 + 1e-5) + 1e-12).all())
    assert float(back[5].abs().max()) == 0.0 and float(back[6, :256].abs().max()) == 0.0
    if asym:
        wg = w.reshape(64, 32, 32)
        assert bool((group_values(m, 1024) <= wg.amin(-1)).all())
    ref = quantize_int4(w, 32, asym, "f32")
    rms = [float((dequantize_int4(*q) - w).pow(2).mean().sqrt()) for q in (ref, (p, s, m))]
    assert rms[1] < rms[0] * 1.03, rms
    with pytest.raises(ValueError, match="multiple of 256"):
        quantize_int4(torch.randn(4, 576), 32, asym, "k")


def test_kernels_come_from_the_compile_cache(tmp_path):
    """The kernel library is a compile-cache entry: a fresh process whose cache holds it loads it
    without a compiler (CXX fails), and a corrupt copy is discarded, not loaded (then built: here,
    with no compiler, the kernels are reported unavailable)."""
    import shutil

    from nxdc.cache.store import CompileCache
    from nxdc.kernels import LIBRARY, kernel_entry, loaded_library

    assert ensure_loaded()
    ns, key, parts = kernel_entry()
    src = tmp_path / "src"
    src.mkdir()
    shutil.copy2(loaded_library()[1], src / LIBRARY)
    CompileCache(tmp_path / "cache").put(ns, key, parts, src)
    broken = tmp_path / "cxx"
    broken.write_text("#!/bin/sh\nexit 1\n")
    broken.chmod(0o755)
    env = {**os.environ, "NXDC_CACHE_DIR": str(tmp_path / "cache"), "CXX": str(broken), "CC": str(broken)}
    script = "from nxdc.kernels import ensure_loaded; r = ensure_loaded(); print(r.ok, r.reason)"
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert res.stdout.split() == ["True", "hit"], res.stderr[-2000:]
    lib = CompileCache(tmp_path / "cache").entry_dir(ns, key) / LIBRARY
    with open(lib, "r+b") as f:
        f.seek(4096)
        f.write(b"corrupt")
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert res.stdout.startswith("False unavailable"), res.stdout + res.stderr[-2000:]
    assert "corrupt entry discarded" in res.stdout + res.stderr or not lib.exists()


def test_avx2_path_matches_reference():
    """The AVX2 + FMA + F16C path (forced with NXDC_KERNELS_AVX2=1 in a fresh process), which also
    takes the at::mm / dequantise + at::mm route for M > 32; up to 32 rows, every row equals the
    1-row call bit for bit, as on the AVX-512 path."""
    script = textwrap.dedent(
        """
        import torch
        from nxdc.kernels import ensure_loaded
        from nxdc.model.quant import quantize_int4, quantize_int8, dequantize_int4, dequantize_int8
        assert ensure_loaded()
        worst = 0.0
        for rows in (1, 3, 8, 9, 40, 100):  # 40, 100: dequantise + at::mm
            for n, k in ((7, 100), (67, 576), (33, 1000), (50, 13), (300, 64), (96, 576)):
                torch.manual_seed(rows + n + k)
                x, w = torch.randn(rows, k), torch.randn(n, k)
                cases = [(torch.ops.nxdc.linear_f32, (w,), w),
                         (torch.ops.nxdc.linear_f16, (w.half(),), w.half().float()),
                         (torch.ops.nxdc.linear_bf16, (w.bfloat16(),), w.bfloat16().float())]
                q, s = quantize_int8(w)
                cases.append((torch.ops.nxdc.linear_i8, (q, s), dequantize_int8(q, s)))
                if k % 32 == 0:
                    q, s = quantize_int8(w, 32)
                    cases.append((torch.ops.nxdc.linear_i8, (q, s), dequantize_int8(q, s)))
                    p, s, m = quantize_int4(w, 32, True, "f16")  # fp16 scales and mins
                    cases.append((torch.ops.nxdc.linear_i4, (p, s, m), dequantize_int4(p, s, m)))
                for f, args, wd in cases:
                    if rows <= 32:  # streaming kernel: each row as the 1-row call gives it, bit for bit
                        alone = torch.cat([f(x[i : i + 1], *args) for i in range(rows)])
                        assert torch.equal(f(x, *args), alone), (f, rows, n, k)
                    got, ref = f(x, *args).double(), x.double() @ wd.double().t()
                    bound = 1e-6 * k ** 0.5 * (x.double().abs() @ wd.double().abs().t()) + 1e-30
                    worst = max(worst, ((got - ref).abs() / bound).max().item())
                    if n % 2 == 0:  # swiglu: the same sums (any route), then SiLU within fp32 ulps
                        lin = f(x, *args).double()
                        sw = torch.ops.nxdc.swiglu(x, *args)
                        ref = torch.nn.functional.silu(lin[:, : n // 2]) * lin[:, n // 2 :]
                        assert ((sw.double() - ref).abs() <= 4e-7 * ref.abs() + 1e-30).all(), (f, rows, n, k)
        print("WORST", worst)
        """
    )
    env = dict(os.environ, NXDC_KERNELS_AVX2="1")
    res = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    worst = float(res.stdout.split("WORST")[-1])
    assert worst <= 1.0


class FormatLinears(torch.nn.Module):
    def __init__(self, n: int, k: int):
        super().__init__()
        w = torch.randn(n, k)
        q, s = quantize_int8(w)
        qg, sg = quantize_int8(w, 32)
        self.register_buffer("w32", w)
        self.register_buffer("w16", w.half())
        self.register_buffer("wbf", w.bfloat16())
        self.register_buffer("q", q)
        self.register_buffer("s", s)
        self.register_buffer("qg", qg)
        self.register_buffer("sg", sg)

    def forward(self, x):
        ops = torch.ops.nxdc
        return (
            ops.linear_f32(x, self.w32),
            ops.linear_f16(x, self.w16),
            ops.linear_bf16(x, self.wbf),
            ops.linear_i8(x, self.q, self.s),
            ops.linear_i8(x, self.qg, self.sg),
            ops.swiglu(x, self.w32),
            ops.swiglu(x, self.q, self.s),
        )


def test_export_and_aoti_bit_identical(tmp_path):
    from torch._inductor import aoti_compile_and_package, aoti_load_package

    torch.manual_seed(4)
    mod = FormatLinears(68, 96).eval()
    m = torch.export.Dim("m", min=1, max=1024)
    ep = torch.export.export(mod, (torch.randn(4, 96),), dynamic_shapes=({0: m},), strict=False)
    code = ep.graph_module.code
    for name in ("linear_f32", "linear_f16", "linear_bf16", "linear_i8", "swiglu"):
        assert f"nxdc.{name}" in code
    pkg = aoti_compile_and_package(ep, package_path=str(tmp_path / "lowp.pt2"))
    runner = aoti_load_package(pkg)
    for rows in (1, 5, 8, 9, 64):
        x = torch.randn(rows, 96)
        eager = mod(x)
        compiled = runner(x)
        assert len(compiled) == len(eager)
        for a, b in zip(compiled, eager, strict=True):
            assert torch.equal(a, b)


def test_quantize_int8_round_trip():
    torch.manual_seed(5)
    w = torch.randn(37, 576) * torch.rand(37, 1) * 3
    w[3] = 0.0  # an all-zero row: scale 0, q 0
    for g in (None, 32, 64):
        q, s = quantize_int8(w, g)
        assert q.dtype == torch.int8 and s.dtype == torch.float32
        assert s.shape == ((37,) if g is None else (37, 576 // g))
        assert int(q.abs().max()) == 127 and int(q.min()) >= -127
        sx = s.unsqueeze(1).expand(37, 576) if g is None else s.repeat_interleave(g, dim=1)
        err = (dequantize_int8(q, s).double() - w.double()).abs()
        # half a step, plus fp32's rounding of w / scale (|w / scale| <= 127)
        assert bool((err <= sx.double() * (0.5 + 127 * 2.0**-23) + 1e-12).all())
        assert torch.equal(q[3], torch.zeros(576, dtype=torch.int8))
        assert float(s[3].abs().max()) == 0.0
        # a row reaches +-127 unless it is zero; a group 127 - t (its scale max|w| / (127 - t))
        qa = q.abs().reshape(37, -1, 576 if g is None else g).amax(-1)
        low = 127 if g is None else 127 - max(SCALE_STEPS)
        assert bool(((qa >= low) | (s == 0).reshape(qa.shape)).all())
        if g is not None:  # never more squared error than Q8_0's max|w| / 127, less in some groups
            wg = w.reshape(37, -1, g)
            q8_0 = wg.abs().amax(-1, keepdim=True) / 127
            base = (torch.round(wg / q8_0.clamp_min(1e-30)) * q8_0 - wg).square().sum(-1)
            ours = (dequantize_int8(q, s) - w).reshape(37, -1, g).square().sum(-1)
            assert bool((ours <= base * (1 + 1e-5)).all()) and bool((ours < base * 0.99).any())
            # and the least of every step's error, each formed directly from w / scale
            amax = wg.abs().amax(-1, keepdim=True).clamp_min(1e-30)
            steps = torch.stack(
                [
                    (torch.round(wg / (amax / (127 - t))) * (amax / (127 - t)) - wg).square().sum(-1)
                    for t in SCALE_STEPS
                ]
            )
            assert bool((ours <= steps.amin(0) * (1 + 1e-5) + 1e-30).all())


def test_quantize_int8_by_row_chunks(monkeypatch):
    """Rows are quantized independently: a small chunk gives one pass's results."""
    import nxdc.model.quant as quant

    w = torch.randn(37, 576)
    whole = quantize_int8(w, 32)
    monkeypatch.setattr(quant, "CHUNK_WEIGHTS", 576 * 5)
    chunked = quantize_int8(w, 32)
    assert torch.equal(whole[0], chunked[0]) and torch.equal(whole[1], chunked[1])


def test_quantize_int8_rejects_bad_groups():
    with pytest.raises(ValueError, match="multiple of 16"):
        quantize_int8(torch.randn(4, 96), 24)
    with pytest.raises(ValueError, match="divides K=96"):
        quantize_int8(torch.randn(4, 96), 64)
    with pytest.raises(ValueError, match="2-D"):
        quantize_int8(torch.randn(96))


def test_linear_module_uses_the_kernel_for_fp32_at_any_row_count():
    from nxdc.model.layers import Linear

    torch.manual_seed(7)
    lin = Linear(64, 32, True, torch.float32, kernels=True)
    torch.nn.init.normal_(lin.weight)
    torch.nn.init.normal_(lin.bias)
    for shape in [(1, 1, 64), (4, 1, 64), (2, 16, 64)]:
        x = torch.randn(*shape)
        torch.testing.assert_close(lin(x), F.linear(x, lin.weight, lin.bias), rtol=1e-5, atol=1e-5)
    for rows in (1, 16):
        gm = torch.export.export(lin, (torch.randn(2, rows, 64),), strict=False).graph_module
        assert "nxdc.linear_f32" in gm.code
    plain = Linear(64, 32, True, torch.float32)  # kernels off (the default)
    plain.load_state_dict(lin.state_dict())
    gm = torch.export.export(plain, (torch.randn(2, 1, 64),), strict=False).graph_module
    assert "nxdc.linear_f32" not in gm.code


@pytest.mark.parametrize(
    "bias, stored", [(False, None), (False, "int8"), (False, "int4-asym-g32"), (False, "fp16"), (True, None)]
)
def test_mlp_routes_gate_up_through_swiglu(bias, stored):
    """With the kernels, an MLP without biases runs gate/up and SiLU as one ``nxdc::swiglu`` call (any
    stored format) and matches PyTorch's SiLU on the linear's halves; with biases, or without the
    kernels, it keeps the linear op and PyTorch's SiLU."""
    from nxdc.model.layers import MLP
    from nxdc.spec import ModelSpec, RopeSpec

    spec = ModelSpec(
        "llama", 10, 64, 48, 1, 4, 2, 16, 1e-5, RopeSpec(theta=10000.0), 32, False, mlp_bias=bias
    )
    torch.manual_seed(9)
    mlp = MLP(spec, torch.float32, kernels=True)
    for p in mlp.parameters():
        torch.nn.init.normal_(p, std=0.2)
    ref_in = torch.randn(2, 3, 64)
    gu = mlp.gate_up_proj
    if stored:
        w = gu.weight.detach().clone()
        gu.store_as(stored)
        if stored == "int8":
            q, s = quantize_int8(w)
            gu.weight.data, gu.scale.data = q, s
            w = dequantize_int8(q, s)
        elif stored.startswith("int4"):
            p, s, m = quantize_int4(w, 32, asymmetric=True)
            gu.weight.data, gu.scale.data, gu.min.data = p, s, m
            w = dequantize_int4(p, s, m)
        else:
            gu.weight.data = w.half()
            w = w.half().float()
    else:
        w = gu.weight.detach()
    full = F.linear(ref_in, w, gu.bias)
    want = mlp.down_proj(F.silu(full[..., :48]) * full[..., 48:])
    torch.testing.assert_close(mlp(ref_in), want, rtol=1e-5, atol=1e-5)
    code = torch.export.export(mlp, (ref_in,), strict=False).graph_module.code
    assert ("nxdc.swiglu" in code) == (not bias)
    plain = MLP(spec, torch.float32)  # kernels off (the default), the same weights
    if stored:
        plain.gate_up_proj.store_as(stored)
    plain.load_state_dict(mlp.state_dict())
    torch.testing.assert_close(plain(ref_in), want, rtol=1e-5, atol=1e-5)
    assert "nxdc.swiglu" not in torch.export.export(plain, (ref_in,), strict=False).graph_module.code


def test_fakes_only_for_ops_the_library_defines(monkeypatch):
    """An export made by an older nxdc carries a library without the newer ops (``swiglu``), and
    ``generate`` loads that copy: registering the shape functions must skip ops it lacks."""
    import nxdc.kernels as k

    assert set(k._FAKES) >= {"attend", "linear_f32", "linear_i8", "swiglu"}
    monkeypatch.setattr(k, "_FAKES", {"no_such_op": lambda x: x})  # the loaded ones are registered already
    k._register_fake()  # raised "operator nxdc::no_such_op does not exist" before
    assert not hasattr(torch.ops.nxdc, "no_such_op")
