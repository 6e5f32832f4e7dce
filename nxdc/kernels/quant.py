"""Weight quantisation for nxdc's reduced-precision kernels (``nxdc::linear_i8``).

int8 is symmetric (no zero point): ``w ~= q * scale`` with ``q`` in [-127, 127] and one fp32 scale
per output row (``scale [N]``) or per group of ``group_size`` consecutive inputs of a row
(``scale [N, K // group_size]``), ``scale = max|w| / 127`` over the row / group. Rounding is to
nearest, so ``|q * scale - w| <= scale / 2`` elementwise (up to fp32 rounding of the division).
An all-zero row / group gets scale 0 and q 0."""

from __future__ import annotations

import torch

QMAX = 127


def _check_group(k: int, group_size: int | None) -> None:
    if group_size is None:
        return
    if group_size <= 0 or group_size % 16 or k % group_size:
        raise ValueError(
            f"group_size must be a positive multiple of 16 that divides K={k} (the kernel's "
            f"vectors never straddle a group), got {group_size}"
        )


def quantize_int8(w: torch.Tensor, group_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 of a weight ``w [N, K]``: returns ``(q int8 [N, K], scale fp32)`` where
    scale is ``[N]`` (``group_size=None``: per output channel) or ``[N, K // group_size]``."""
    if w.dim() != 2:
        raise ValueError(f"quantize_int8 expects a 2-D weight [N, K], got shape {tuple(w.shape)}")
    n, k = w.shape
    _check_group(k, group_size)
    wf = w.detach().to(torch.float32)
    g = k if group_size is None else group_size
    wg = wf.reshape(n, k // g, g) if k else wf.reshape(n, 0, 1)
    scale = wg.abs().amax(dim=-1) / QMAX if k else wf.new_zeros((n, 0))
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(wg / safe.unsqueeze(-1)).clamp_(-QMAX, QMAX).to(torch.int8).reshape(n, k)
    if group_size is None:
        scale = scale.reshape(n) if k else wf.new_zeros(n)
    return q.contiguous(), scale.contiguous()


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fp32 ``q * scale`` exactly as the kernels form it (per row, or per group with the group
    size ``K // scale.shape[1]``)."""
    n, k = q.shape
    if scale.dim() == 1:
        return q.to(torch.float32) * scale.to(torch.float32).unsqueeze(1)
    ng = scale.shape[1]
    _check_group(k, k // ng if ng else 0)
    qg = q.to(torch.float32).reshape(n, ng, k // ng)
    return (qg * scale.to(torch.float32).unsqueeze(-1)).reshape(n, k)
