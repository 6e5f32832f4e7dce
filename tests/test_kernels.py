"""nxdc's CPU decode kernel equals F.linear (fp32 rounding only) for every row count it
handles, and falls back to PyTorch where it does not apply."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from nxdc.kernels import MAX_ROWS, cpu_supported, ensure_loaded

needs_kernels = pytest.mark.skipif(not cpu_supported(), reason="CPU without AVX2/FMA: kernels are not used")


@needs_kernels
@pytest.mark.parametrize("rows", range(1, MAX_ROWS + 1))
@pytest.mark.parametrize("n, k", [(1, 8), (7, 64), (67, 576), (1536, 576), (576, 1536)])
def test_skinny_linear_matches_f_linear(rows, n, k):
    assert ensure_loaded()
    torch.manual_seed(rows * n + k)
    x, w = torch.randn(rows, k), torch.randn(n, k)
    got = torch.ops.nxdc.skinny_linear(x, w)
    torch.testing.assert_close(got, F.linear(x, w), rtol=1e-5, atol=1e-5 * k**0.5)


@needs_kernels
@pytest.mark.parametrize("shape", [(MAX_ROWS + 1, 64), (2, 60)])
def test_skinny_linear_falls_back(shape):
    assert ensure_loaded()
    x, w = torch.randn(*shape), torch.randn(33, shape[1])
    torch.testing.assert_close(torch.ops.nxdc.skinny_linear(x, w), F.linear(x, w))


@needs_kernels
def test_linear_module_uses_kernel_only_for_few_rows():
    from nxdc.model.layers import Linear, use_skinny_kernels

    assert ensure_loaded()
    lin = Linear(64, 32, True, torch.float32)
    torch.nn.init.normal_(lin.weight)
    torch.nn.init.normal_(lin.bias)
    use_skinny_kernels(lin)
    for shape in [(1, 1, 64), (4, 1, 64), (2, 16, 64)]:
        x = torch.randn(*shape)
        torch.testing.assert_close(lin(x), F.linear(x, lin.weight, lin.bias), rtol=1e-5, atol=1e-5)
    gm = torch.export.export(lin, (torch.randn(2, 1, 64),), strict=False).graph_module
    assert "nxdc.skinny_linear" in gm.code
    gm = torch.export.export(lin, (torch.randn(2, 16, 64),), strict=False).graph_module
    assert "nxdc.skinny_linear" not in gm.code
