"""``nxdc::attend`` (kernels/attention.cpp), the prefill / decode / verify attention over the KV
cache: equal to masked SDPA in fp64 up to fp32 rounding, for decode (T = 1), verify (T > 1) and
prefill (T = the prompt, rows in several blocks and threads) shapes,
per-sequence positions, head dims 64 / 128 / 24, fp32 / fp16 / bf16 caches (read as the fp32
values they hold); a verify or prefill row equals the decode row at the same position bit for
bit, and the AVX-512 path (rows two at a time) equals the AVX2 path (one at a time) bit for bit;
slots past a row's position are never read; bad input is refused."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

from nxdc.kernels import cpu_supported, ensure_loaded

pytestmark = pytest.mark.skipif(not cpu_supported(), reason="CPU without AVX2/FMA: kernels are not used")


@pytest.fixture(scope="module", autouse=True)
def _loaded():
    assert ensure_loaded()


def reference(q, k, v, positions):
    b, h, r, d = q.shape
    t, s = positions.shape[1], k.shape[2]
    g = r // t
    slots = torch.arange(s)
    mask = (slots.view(1, 1, -1) <= positions.unsqueeze(-1)).unsqueeze(1)  # [B, 1, T, S]
    gmask = mask.unsqueeze(2).expand(b, 1, g, t, s).reshape(b, 1, r, s)
    return F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=gmask)


@pytest.mark.parametrize(
    "b, h, g, t, s, d",
    [
        (1, 3, 3, 1, 256, 64),
        (8, 3, 3, 1, 64, 64),
        (2, 2, 4, 5, 40, 128),
        (3, 1, 2, 3, 17, 24),
        (1, 4, 1, 1, 9, 8),
        (1, 3, 3, 70, 80, 64),  # prefill-like: 210 rows per KV head, several row blocks
        (2, 2, 2, 37, 40, 128),
    ],
)
def test_matches_masked_sdpa(b, h, g, t, s, d):
    torch.manual_seed(b * 1000 + s + d)
    q, k, v = torch.randn(b, h, g * t, d), torch.randn(b, h, s, d), torch.randn(b, h, s, d)
    start = torch.randint(0, s - t + 1, (b,))
    start[0] = 0  # a row that attends to one slot only
    positions = start.view(-1, 1) + torch.arange(t).view(1, -1)
    got = torch.ops.nxdc.attend(q, k, v, positions)
    assert got.shape == q.shape and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), reference(q, k, v, positions), rtol=0, atol=2e-6)


@pytest.mark.parametrize("cache", [torch.float16, torch.bfloat16])
def test_16_bit_caches_are_read_as_their_fp32_values(cache):
    torch.manual_seed(3)
    b, h, g, t, s, d = 2, 3, 3, 2, 48, 64
    q, k, v = (
        torch.randn(b, h, g * t, d),
        torch.randn(b, h, s, d).to(cache),
        torch.randn(b, h, s, d).to(cache),
    )
    positions = torch.tensor([[5, 6], [40, 41]])
    got = torch.ops.nxdc.attend(q, k, v, positions)
    assert got.dtype == torch.float32
    assert torch.equal(got, torch.ops.nxdc.attend(q, k.float(), v.float(), positions))


@pytest.mark.parametrize("cache", [torch.float32, torch.float16, torch.bfloat16])
def test_verify_rows_equal_decode_rows_bit_for_bit(cache):
    torch.manual_seed(1)
    b, h, g, t, s, d = 2, 3, 3, 5, 64, 64
    k, v = torch.randn(b, h, s, d).to(cache), torch.randn(b, h, s, d).to(cache)
    qv = torch.randn(b, h, g, t, d)  # verify queries, [.., G, T, D] -> rows g * T + t
    start = torch.tensor([7, 30])
    positions = start.view(-1, 1) + torch.arange(t).view(1, -1)
    verify = torch.ops.nxdc.attend(qv.reshape(b, h, g * t, d), k, v, positions).view(b, h, g, t, d)
    for j in range(t):
        decode = torch.ops.nxdc.attend(qv[:, :, :, j].contiguous(), k, v, positions[:, j : j + 1])
        assert torch.equal(verify[:, :, :, j], decode)


def test_prefill_rows_equal_decode_rows_and_the_avx2_path_bit_for_bit(tmp_path):
    """A 100-token prefill (positions 0..99, the causal mask) against decode calls at each
    position, in this process and in one forced onto the AVX2 path (NXDC_KERNELS_AVX2=1), which
    takes rows one at a time where AVX-512 CPUs take them in pairs: every output bit for bit."""
    script = textwrap.dedent(
        """
        import sys, torch
        from nxdc.kernels import ensure_loaded
        assert ensure_loaded()
        torch.manual_seed(4)
        b, h, g, t, s, d = 1, 3, 3, 100, 128, 64
        q, k, v = torch.randn(b, h, g * t, d), torch.randn(b, h, s, d), torch.randn(b, h, s, d)
        positions = torch.arange(t).view(1, t)
        prefill = torch.ops.nxdc.attend(q, k, v, positions).view(b, h, g, t, d)
        for j in range(t):
            row = q.view(b, h, g, t, d)[:, :, :, j].contiguous()
            assert torch.equal(prefill[:, :, :, j], torch.ops.nxdc.attend(row, k, v, positions[:, j : j + 1])), j
        torch.save(prefill, sys.argv[1])
        """
    )
    outs = []
    for avx2 in ("0", "1"):
        path = str(tmp_path / f"avx2-{avx2}.pt")
        env = dict(os.environ, NXDC_KERNELS_AVX2=avx2)
        res = subprocess.run(
            [sys.executable, "-c", script, path], env=env, capture_output=True, text=True, timeout=600
        )
        assert res.returncode == 0, res.stderr[-3000:]
        outs.append(torch.load(path))
    assert torch.equal(outs[0], outs[1])


def test_slots_past_the_position_are_never_read():
    torch.manual_seed(2)
    q, k, v = torch.randn(1, 2, 3, 64), torch.randn(1, 2, 32, 64), torch.randn(1, 2, 32, 64)
    positions = torch.tensor([[10]])
    before = torch.ops.nxdc.attend(q, k, v, positions)
    k[:, :, 11:], v[:, :, 11:] = float("nan"), float("nan")
    assert torch.equal(torch.ops.nxdc.attend(q, k, v, positions), before)


def test_bad_input_is_refused():
    q, k = torch.randn(1, 2, 3, 64), torch.randn(1, 2, 16, 64)
    with pytest.raises(RuntimeError, match="outside the cache"):
        torch.ops.nxdc.attend(q, k, k, torch.tensor([[16]]))
    with pytest.raises(RuntimeError, match="multiple of 8"):
        torch.ops.nxdc.attend(
            torch.randn(1, 2, 3, 12),
            torch.randn(1, 2, 16, 12),
            torch.randn(1, 2, 16, 12),
            torch.tensor([[3]]),
        )
    with pytest.raises(RuntimeError, match="q must be float32"):
        torch.ops.nxdc.attend(q.double(), k, k, torch.tensor([[3]]))
    with pytest.raises(RuntimeError, match="caches must be both"):
        torch.ops.nxdc.attend(q, k.double(), k.double(), torch.tensor([[3]]))
    with pytest.raises(RuntimeError, match="caches must be both"):
        torch.ops.nxdc.attend(q, k.half(), k.bfloat16(), torch.tensor([[3]]))
    with pytest.raises(RuntimeError, match="do not match"):
        torch.ops.nxdc.attend(q, k, k, torch.tensor([[3, 4]]))  # 3 rows are not a multiple of T = 2
