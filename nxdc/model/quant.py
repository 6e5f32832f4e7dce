"""Weight quantisation: the stored int8 / int4 formats and their reference dequantisation, which
nxdc's kernels (``nxdc::linear_i8``, ``linear_i4``) reproduce and the model's PyTorch path runs.

int8 is symmetric (no zero point): ``w ~= q * scale`` with ``q`` in [-127, 127] and one fp32 scale
per output row (``scale [N]``) or per group of ``group_size`` consecutive inputs of a row
(``scale [N, K // group_size]``). A row's scale is ``max|w| / 127``; a group's is
``max|w| / (127 - t)`` for the ``t`` in ``SCALE_STEPS`` (0, 1, ..., 32) whose rounding leaves the
least squared error (``t = 0`` on a tie: llama.cpp's Q8_0 choice, so a Q8_0-origin group
requantizes exactly). A slightly coarser step often lands more of a group's weights near a level:
on Gaussian weights the search leaves 20% less squared error than ``max|w| / 127``; on SmolLM2,
whose weights are Q4_1's 16 levels a group, 75% less, and its mean next-token KL to fp32 falls
72% (``bench/int8_scales.py``; docs/weights.md). Per row it gained nothing measurable. Rounding is to nearest,
so ``|q * scale - w| <= scale / 2`` elementwise (up to fp32 rounding of the division), and no
weight is clipped. An all-zero row / group gets scale 0 and q 0.

int4 is group-wise, stored two weights a byte (``pack_int4``: in blocks of 32 weights, byte j holds
weight j in its low nibble and weight 16 + j in its high one, GGUF Q4_0's order). Symmetric:
``w ~= (nibble - 8) * scale`` with llama.cpp Q4_0's choice of scale (the group's value of largest
magnitude maps to -8, so the 16 levels are all used). Asymmetric: ``w ~= nibble * scale + min``
with ``min`` the group's minimum and ``scale = (max - min) / 15``.

``scales`` says how group scales (and mins) are stored (``weight_format.SCALES``): fp32; fp16
(``--weights int4``'s default: each rounded to the nearest fp16); or two-level, ``k`` (per 256
weights an fp16 ``d``, per group an int8 factor ``c``, the value ``d * c``: a GGUF K-quant's form,
``two_level``). Either way the values are rounded first and the codes chosen against the rounded
values, so the stored triple dequantizes as above with no further rounding (the kernels form
``d * c`` and convert fp16 to fp32 exactly). Two-level rounding is directed so that no weight is
clipped: a scale rounds away from zero, a min down, and the scale covers the group's range from
its rounded min.

Either format may carry a ``min`` per group (``w = q * scale + min``: multiply, then add, as
gguf's Q4_1 / Q4_K / Q5_K dequantisation does): how GGUF files keep their bits (``nxdc.weights.gguf_quant``)."""

from __future__ import annotations

import torch

from nxdc.model.weight_format import SUPER

QMAX = 127
SCALE_STEPS = tuple(range(33))  # a group's scale: max|w| / (QMAX - t), t one of these
# quantize_int8 works this many weights at a time: the scale search's three fp32 buffers stay
# in a 2 MiB L2 (14336 x 4096 weights: 1.2-1.5 s, 2.2-2.6 s at 4M a chunk)
CHUNK_WEIGHTS = 1 << 17


def _check_group(k: int, group_size: int | None) -> None:
    if group_size is None:
        return
    if group_size <= 0 or group_size % 16 or k % group_size:
        raise ValueError(
            f"group_size must be a positive multiple of 16 that divides K={k} (the kernel's "
            f"vectors never straddle a group), got {group_size}"
        )


def quantize_int8(
    w: torch.Tensor, group_size: int | None = None, scales: str = "f32"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 of a weight ``w [N, K]``: returns ``(q int8 [N, K], scale)`` where scale is
    ``[N]`` (``group_size=None``: per output channel) or per group of ``group_size``, stored as
    ``scales`` says (group scales only: fp32 ``[N, K // G]``, fp16, or two-level)."""
    if w.dim() != 2:
        raise ValueError(f"quantize_int8 expects a 2-D weight [N, K], got shape {tuple(w.shape)}")
    n, k = w.shape
    _check_group(k, group_size)
    if scales != "f32" and group_size is None:
        raise ValueError(f"quantize_int8: {scales} scales are for group scales only")
    _check_scales(k, group_size, scales)
    g = k if group_size is None else group_size
    q = torch.empty((n, k), dtype=torch.int8)
    stored = []
    step = max(1, CHUNK_WEIGHTS // max(1, k))
    for r in range(0, n if k else 0, step):
        wg = w[r : r + step].detach().to(torch.float32).reshape(-1, k // g, g)
        s = _least_error_scale(wg) if group_size else wg.abs().amax(dim=-1) / QMAX
        kept, s = rounded(s, scales, g, "out")
        safe = torch.where(s > 0, s, torch.ones_like(s)).unsqueeze(-1)
        q[r : r + step] = torch.round(wg / safe).clamp_(-QMAX, QMAX).reshape(-1, k).to(torch.int8)
        stored.append(kept)
    if group_size is None:
        return q, torch.cat(stored).reshape(n) if stored else torch.zeros(n)
    return q, torch.cat(stored) if stored else rounded(torch.zeros(n, k // g), scales, g, "out")[0]


def _check_scales(k: int, group_size: int | None, scales: str) -> None:
    if scales == "k" and (group_size is None or SUPER % group_size or k % SUPER):
        raise ValueError(
            f"two-level scales need groups that divide {SUPER} weights and K={k} a multiple of {SUPER}"
        )


def rounded(v: torch.Tensor, scales: str, group: int, way: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Group values ``v [N, groups]`` (fp32) as ``scales`` stores them: ``(stored, their fp32
    values)``. fp32 as they are; fp16 to nearest; two-level (``two_level``) rounded ``way``:
    ``out`` (away from zero: a scale that clips nothing) or ``down`` (a min at or below)."""
    if scales == "f32":
        return v, v
    if scales == "f16":
        h = v.half()
        return h, h.float()
    stored = two_level(v, SUPER // group, way)
    return stored, group_values(stored, v.shape[1] * group)


def two_level(v: torch.Tensor, gps: int, way: str) -> torch.Tensor:
    """Group values ``v [N, groups]`` -> the two-level layout (``group_values``) with ``gps``
    groups a super-block: ``d`` the fp16 at or above ``max|v| / 127`` nearest to it, each ``c``
    ``v / d`` rounded ``way`` (``out``: away from zero; ``down``), so ``|c| <= 127`` and each value
    moves by less than ``d`` (its super-block's largest / 127), in the chosen direction."""
    n, ng = v.shape
    nsb = ng // gps
    sb = v.reshape(n, nsb, gps)
    top = sb.abs().amax(dim=-1)
    d = (top / QMAX).half()
    short = d.float() * QMAX < top  # rounded below: the next fp16 up (d > 0 here, so +1 ulp)
    d = torch.where(short, (d.view(torch.int16) + 1).view(torch.float16), d)
    df = d.float().unsqueeze(-1)
    r = sb / torch.where(df > 0, df, torch.ones_like(df))
    c = torch.floor(r) if way == "down" else torch.ceil(r.abs()) * torch.sign(r)
    return pack_two_level(d, c.clamp_(-128, QMAX).reshape(n, ng))


def pack_two_level(d: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """Super-block factors ``d [N, nsb]`` (fp16 values) and integer group factors ``c [N, ng]``
    -> the two-level layout ``uint8 [N, 2 * nsb + ng]`` that ``group_values`` reads."""
    n, nsb = d.shape
    out = torch.empty(n, 2 * nsb + c.shape[1], dtype=torch.uint8)
    out[:, : 2 * nsb] = d.half().contiguous().view(torch.uint8)
    out[:, 2 * nsb :] = c.round().to(torch.int8).view(torch.uint8)
    return out


def _least_error_scale(wg: torch.Tensor) -> torch.Tensor:
    """``max|w| / (127 - t)`` per group of ``wg [rows, groups, G]`` for the ``t`` in
    ``SCALE_STEPS`` of least squared rounding error (the first such on a tie). Works on
    ``r = w / max|w|``: with ``n = 127 - t`` levels the error is ``(max|w| / n)^2 * sum((r n -
    round(r n))^2)``, so one buffer per step and no division (3x faster than dividing ``w`` by
    each scale)."""
    amax = wg.abs().amax(dim=-1)
    r = wg / torch.where(amax > 0, amax, torch.ones_like(amax)).unsqueeze(-1)
    x, xr = torch.empty_like(r), torch.empty_like(r)
    best_n, best_err = torch.full_like(amax, float(QMAX - SCALE_STEPS[0])), None
    for t in SCALE_STEPS:
        n = float(QMAX - t)
        torch.mul(r, n, out=x)
        x.sub_(torch.round(x, out=xr))
        err = torch.linalg.vecdot(x, x).div_(n * n)
        if best_err is None:
            best_err = err
            continue
        better = err < best_err
        best_err, best_n = torch.where(better, err, best_err), torch.where(better, n, best_n)
    return amax / best_n


def group_values(t: torch.Tensor, k: int) -> torch.Tensor:
    """Group scales or mins of rows of ``k`` inputs as fp32 ``[N, ng]``, from any stored layout:
    fp32 / fp16 ``[N, ng]``, or two-level, a GGUF K-quant's: uint8 ``[N, 2 * nsb + ng]`` with
    ``nsb = k / 256``, per row the nsb fp16 factors ``d`` (one a super-block), then the ng int8
    factors ``c`` (one a group); a group's value is ``d * c``, exact in fp32 (the kernels'
    ``nxdc_cpu::GroupRows``)."""
    if t.dtype != torch.uint8:
        return t.to(torch.float32)
    nsb = k // SUPER
    d = t[:, : 2 * nsb].contiguous().view(torch.float16).to(torch.float32)  # [N, nsb]
    c = t[:, 2 * nsb :].view(torch.int8).to(torch.float32)
    return (c.reshape(t.shape[0], nsb, -1) * d.unsqueeze(-1)).reshape(c.shape)


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor, mins: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 ``q * scale`` (``+ min``) exactly as the kernels form it (per row, or per group with
    the group size ``K // groups``; scales in any layout ``group_values`` reads)."""
    n, k = q.shape
    if scale.dim() == 1:
        return q.to(torch.float32) * scale.to(torch.float32).unsqueeze(1)
    s = group_values(scale, k)
    ng = s.shape[1]
    _check_group(k, k // ng if ng else 0)
    qg = q.to(torch.float32).reshape(n, ng, k // ng) * s.unsqueeze(-1)
    if mins is not None:
        qg = qg + group_values(mins, k).unsqueeze(-1)
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
    w: torch.Tensor, group_size: int = 32, asymmetric: bool = False, scales: str = "f32"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Group-wise int4 of ``w [N, K]``: ``(packed uint8 [N, K // 2], scale, min or None)``, scale
    and min stored as ``scales`` says (fp32 / fp16 ``[N, K // G]``, or two-level)."""
    if w.dim() != 2:
        raise ValueError(f"quantize_int4 expects a 2-D weight [N, K], got shape {tuple(w.shape)}")
    n, k = w.shape
    _check_int4_group(k, group_size)
    _check_scales(k, group_size, scales)
    wg = w.detach().to(torch.float32).reshape(n, k // group_size, group_size)
    if asymmetric:
        lo, hi = wg.amin(dim=-1), wg.amax(dim=-1)
        mins, lo = rounded(lo, scales, group_size, "down")
        stored, scale = rounded((hi - lo) / 15, scales, group_size, "out")
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))
        q = torch.round((wg - lo.unsqueeze(-1)) / safe.unsqueeze(-1)).clamp_(0, 15)
        mins = mins.contiguous()
    else:  # llama.cpp Q4_0: the value of largest magnitude maps to -8
        idx = wg.abs().argmax(dim=-1, keepdim=True)
        stored, scale = rounded(wg.gather(-1, idx).squeeze(-1) / -8, scales, group_size, "out")
        safe = torch.where(scale != 0, scale, torch.ones_like(scale))
        q = (torch.round(wg / safe.unsqueeze(-1)) + 8).clamp_(0, 15)
        mins = None
    return pack_int4(q.reshape(n, k)), stored.contiguous(), mins


def dequantize_int4(
    packed: torch.Tensor, scale: torch.Tensor, mins: torch.Tensor | None = None
) -> torch.Tensor:
    """fp32 weights exactly as the kernels form them: ``(nibble - 8) * scale``, or
    ``nibble * scale + min``."""
    nib = unpack_int4(packed).to(torch.float32)
    n, k = nib.shape
    s = group_values(scale, k)
    ng = s.shape[1]
    _check_int4_group(k, k // ng if ng else 0)
    q = nib if mins is not None else nib - 8
    w = q.reshape(n, ng, k // ng) * s.unsqueeze(-1)
    if mins is not None:
        w = w + group_values(mins, k).unsqueeze(-1)
    return w.reshape(n, k)
