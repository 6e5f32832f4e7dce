"""Weight quantisation: the stored int8 / int4 formats and their reference dequantisation, which
nxdc's kernels (``nxdc::linear_i8``, ``linear_i4``) reproduce and the model's PyTorch path runs.

int8 is symmetric (no zero point): ``w ~= q * scale`` with ``q`` in [-127, 127] and one fp32 scale
per output row (``scale [N]``) or per group of ``group_size`` consecutive inputs of a row
(``scale [N, K // group_size]``), ``scale = max|w| / 127`` over the row / group. Rounding is to
nearest, so ``|q * scale - w| <= scale / 2`` elementwise (up to fp32 rounding of the division).
An all-zero row / group gets scale 0 and q 0.

int4 is group-wise, stored two weights a byte (``pack_int4``: in blocks of 32 weights, byte j holds
weight j in its low nibble and weight 16 + j in its high one, GGUF Q4_0's order). Symmetric:
``w ~= (nibble - 8) * scale`` with llama.cpp Q4_0's choice of scale (the group's value of largest
magnitude maps to -8, so the 16 levels are all used). Asymmetric: ``w ~= nibble * scale + min``
with ``min`` the group's minimum and ``scale = (max - min) / 15``.

Either format may carry a ``min`` per group (``w = q * scale + min``: multiply, then add, as
gguf's Q4_1 / Q4_K / Q5_K dequantisation does): how GGUF files keep their bits (``nxdc.weights.gguf_quant``)."""

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


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor, mins: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 ``q * scale`` (``+ min``) exactly as the kernels form it (per row, or per group with
    the group size ``K // scale.shape[1]``)."""
    n, k = q.shape
    if scale.dim() == 1:
        return q.to(torch.float32) * scale.to(torch.float32).unsqueeze(1)
    ng = scale.shape[1]
    _check_group(k, k // ng if ng else 0)
    qg = q.to(torch.float32).reshape(n, ng, k // ng) * scale.to(torch.float32).unsqueeze(-1)
    if mins is not None:
        qg = qg + mins.to(torch.float32).unsqueeze(-1)
    return qg.reshape(n, k)


INT4_BLOCK = 32  # weights per packed block; a group is a whole number of blocks


def _check_int4_group(k: int, group_size: int) -> None:
    if group_size <= 0 or group_size % INT4_BLOCK or k % group_size:
        raise ValueError(
            f"int4 group_size must be a positive multiple of {INT4_BLOCK} that divides K={k}, got {group_size}"
        )


def pack_int4(nibbles: torch.Tensor) -> torch.Tensor:
    """``[N, K]`` integers in 0..15 -> ``uint8 [N, K // 2]`` in the kernels' block order."""
    n, k = nibbles.shape
    b = nibbles.to(torch.uint8).reshape(n, k // INT4_BLOCK, 2, INT4_BLOCK // 2)
    return (b[:, :, 0] | (b[:, :, 1] << 4)).reshape(n, k // 2).contiguous()


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """``uint8 [N, K // 2]`` -> the nibbles ``uint8 [N, K]`` (``pack_int4``'s inverse)."""
    n, kb = packed.shape
    b = packed.reshape(n, kb // (INT4_BLOCK // 2), 1, INT4_BLOCK // 2)
    return torch.cat([b & 15, b >> 4], dim=2).reshape(n, kb * 2)


def quantize_int4(
    w: torch.Tensor, group_size: int = 32, asymmetric: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Group-wise int4 of ``w [N, K]``: ``(packed uint8 [N, K // 2], scale fp32 [N, K // G],
    min fp32 [N, K // G] or None)``."""
    if w.dim() != 2:
        raise ValueError(f"quantize_int4 expects a 2-D weight [N, K], got shape {tuple(w.shape)}")
    n, k = w.shape
    _check_int4_group(k, group_size)
    wg = w.detach().to(torch.float32).reshape(n, k // group_size, group_size)
    if asymmetric:
        lo, hi = wg.amin(dim=-1), wg.amax(dim=-1)
        scale = (hi - lo) / 15
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))
        q = torch.round((wg - lo.unsqueeze(-1)) / safe.unsqueeze(-1)).clamp_(0, 15)
        mins = lo.contiguous()
    else:  # llama.cpp Q4_0: the value of largest magnitude maps to -8
        idx = wg.abs().argmax(dim=-1, keepdim=True)
        scale = wg.gather(-1, idx).squeeze(-1) / -8
        safe = torch.where(scale != 0, scale, torch.ones_like(scale))
        q = (torch.round(wg / safe.unsqueeze(-1)) + 8).clamp_(0, 15)
        mins = None
    return pack_int4(q.reshape(n, k)), scale.contiguous(), mins


def dequantize_int4(
    packed: torch.Tensor, scale: torch.Tensor, mins: torch.Tensor | None = None
) -> torch.Tensor:
    """fp32 weights exactly as the kernels form them: ``(nibble - 8) * scale``, or
    ``nibble * scale + min``."""
    nib = unpack_int4(packed).to(torch.float32)
    n, k = nib.shape
    ng = scale.shape[1]
    _check_int4_group(k, k // ng if ng else 0)
    q = nib if mins is not None else nib - 8
    w = q.reshape(n, ng, k // ng) * scale.to(torch.float32).unsqueeze(-1)
    if mins is not None:
        w = w + mins.to(torch.float32).unsqueeze(-1)
    return w.reshape(n, k)
