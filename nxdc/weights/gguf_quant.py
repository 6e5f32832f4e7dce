"""GGUF quantized tensors kept as stored (``--weights auto``): each block's scale and min, and the
nxdc format that holds the block's values exactly.

Every type kept here dequantizes (in gguf's own ``dequantize``) as ``fl(s * q)`` or
``fl(fl(s * q) + m)`` with small integers ``q``, an fp32 scale ``s`` and min ``m`` per sub-block:

| GGUF | q | s, m per | nxdc format |
|---|---|---|---|
| Q8_0 | −128..127 | 32: d | int8 sym g32, fp16 scales |
| Q4_0 | nibble − 8 | 32: d | int4 sym g32, fp16 scales |
| Q4_1 | nibble | 32: d, m | int4 asym g32, fp16 scales |
| Q5_0 | 5 bits − 16 | 32: d | int8 sym g32, fp16 scales |
| Q5_1 | 5 bits | 32: d, m | int8 asym g32, fp16 scales |
| Q4_K | nibble | 32: d·sc, −dmin·m | int4 asym g32 |
| Q5_K | 5 bits | 32: d·sc, −dmin·m | int8 asym g32 |
| Q6_K | 6 bits − 32 | 16: d·sc | int8 sym g16 |

The first five store d and m as fp16, so nxdc keeps them as fp16 (its ``-f16`` formats); a K-quant's
d·sc (an fp16 times a 6-bit integer) needs up to 17 significant bits, so those keep fp32.

nxdc's kernels form exactly those values (``model/quant.py``: multiply, then add), so the export
holds the source's bits: ``requantize`` recovers ``q`` from the dequantized values and the known
``s`` / ``m``, and checks that nxdc's dequantisation gives back gguf's, value for value.

The scales and mins travel beside the values through sharding (``GGUFTensor.read(params=True)``:
``[rows, K, 3]`` = value, scale, min per weight), so row and column cuts, head permutations and
fused q/k/v or gate/up rows all apply to them alike; a format is only valid where every cut falls
on a group boundary (the planner checks it)."""

from __future__ import annotations

import numpy as np
import torch

from nxdc.model.quant import dequantize_int4, dequantize_int8, pack_int4
from nxdc.model.weight_format import WeightFormat

# GGUF type name -> (kind, inputs per scale, has a min, fp16 scales and mins)
KEPT = {
    "Q8_0": ("int8", 32, False, True),
    "Q4_0": ("int4", 32, False, True),
    "Q4_1": ("int4", 32, True, True),
    "Q5_0": ("int8", 32, False, True),
    "Q5_1": ("int8", 32, True, True),
    "Q4_K": ("int4", 32, True, False),
    "Q5_K": ("int8", 32, True, False),
    "Q6_K": ("int8", 16, False, False),
}


def kept_format(type_name: str) -> WeightFormat | None:
    """The nxdc format that holds a GGUF type's values exactly; None if it is not kept."""
    k = KEPT.get(type_name)
    return WeightFormat(*k) if k else None


def common_format(formats: list[WeightFormat | None]) -> WeightFormat | None:
    """One format for a fused weight whose parts come as ``formats``: theirs where they agree,
    else int8 with the smallest group and a min if any part has one (int8 holds every kept type's
    q: nibbles, 5 and 6 bits; a sym part gets min 0, which adds exactly nothing), with fp16 scales
    only if every part has them. None if a part is not kept (the weight is then stored
    dequantized)."""
    if any(f is None for f in formats):
        return None
    if len(set(formats)) == 1:
        return formats[0]
    return WeightFormat(
        "int8", min(f.group for f in formats), any(f.asym for f in formats), all(f.half for f in formats)
    )


def _f16(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32)


def block_params(type_name: str, blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per sub-block fp32 ``(scale, min)`` ``[n_blocks, sub-blocks]`` of raw blocks
    ``uint8 [n_blocks, block bytes]`` (min 0 for symmetric types), formed as gguf forms them."""
    from gguf.quants import Q4_K

    n = blocks.shape[0]
    if type_name in ("Q8_0", "Q4_0", "Q5_0"):
        return _f16(blocks[:, :2]), np.zeros((n, 1), np.float32)
    if type_name in ("Q4_1", "Q5_1"):
        return _f16(blocks[:, :2]), _f16(blocks[:, 2:4])
    if type_name in ("Q4_K", "Q5_K"):
        d, dmin = _f16(blocks[:, :2]), _f16(blocks[:, 2:4])
        sc, m = Q4_K.get_scale_min(np.ascontiguousarray(blocks[:, 4:16]))
        return d * sc.astype(np.float32), -(dmin * m.astype(np.float32))
    if type_name == "Q6_K":
        sc = np.ascontiguousarray(blocks[:, 192:208]).view(np.int8).astype(np.float32)
        return _f16(blocks[:, 208:210]) * sc, np.zeros((n, 16), np.float32)
    raise ValueError(f"GGUF type {type_name} is not kept as stored")


def expanded_params(type_name: str, rows: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Each weight's scale and min, ``[rows, K]`` fp32, for the raw rows ``uint8 [rows, bytes]``."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[type_name]]
    r = rows.shape[0]
    s, m = block_params(type_name, rows.reshape(r * (k // block), size))
    per = block // s.shape[1]  # weights per sub-block
    s = np.repeat(s.reshape(r, -1), per, axis=1)
    m = np.repeat(m.reshape(r, -1), per, axis=1)
    return s, m


# Rows per step of ``requantize``: ~4M weights, so its fp64 temporaries stay ~32 MiB each (whole
# tensors at once held ~7 GiB of them for an 8B model's 49152 x 4096 embedding).
CHUNK_WEIGHTS = 1 << 22


def requantize(
    w: torch.Tensor, s: torch.Tensor, m: torch.Tensor, fmt: WeightFormat, name: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``(q, scale, min)`` in ``fmt`` for dequantized values ``w [N, K]`` whose scale / min per
    weight are ``s`` / ``m``: exactly the source's values, or AssertionError. Row chunk by row
    chunk."""
    n, k = w.shape
    step = max(1, CHUNK_WEIGHTS // max(1, k))
    parts, bad = [], 0
    for r in range(0, n, step):
        part, wrong = _requantize_rows(w[r : r + step], s[r : r + step], m[r : r + step], fmt, name)
        parts.append(part)
        bad += wrong
    if bad:
        raise AssertionError(f"{name}: {bad} values of the GGUF tensor are not kept exactly in {fmt.name}")
    stored, scale, mins = (torch.cat([p[i] for p in parts]) if parts else None for i in range(3))
    return stored, scale, (mins if fmt.asym else None)


def _stored_params(
    scale: torch.Tensor, mins: torch.Tensor, fmt: WeightFormat
) -> tuple[torch.Tensor, torch.Tensor]:
    """A group's scale and min in the format's dtype: fp16 only where that holds them exactly."""
    if not fmt.half:
        return scale, mins
    s16, m16 = scale.half(), mins.half()
    if not (torch.equal(s16.float(), scale) and torch.equal(m16.float(), mins)):
        raise AssertionError(f"{fmt.name}: a GGUF scale or min is not an fp16 value")
    return s16, m16


def _requantize_rows(w, s, m, fmt: WeightFormat, name: str) -> tuple[tuple[torch.Tensor, ...], int]:
    """``requantize`` of some rows: ``((q, scale, min), values not given back exactly)``."""
    n, k = w.shape
    g = fmt.group
    sg, mg = s.reshape(n, k // g, g), m.reshape(n, k // g, g)
    if not (torch.equal(sg, sg[..., :1].expand_as(sg)) and torch.equal(mg, mg[..., :1].expand_as(mg))):
        raise AssertionError(f"{name}: GGUF scales change within a {g}-weight group of {fmt.name}")
    scale, mins = _stored_params(sg[..., 0].contiguous(), mg[..., 0].contiguous(), fmt)
    sd = s.double()
    safe = torch.where(sd != 0, sd, torch.ones_like(sd))
    q = torch.round((w.double() - m.double()) / safe).where(sd != 0, torch.zeros_like(sd))
    if fmt.kind == "int4":
        q = q if fmt.asym else q + 8  # the stored nibble
        stored = pack_int4(q.clamp(0, 15).to(torch.uint8))
        back = dequantize_int4(stored, scale, mins if fmt.asym else None)
    else:
        stored = q.clamp(-128, 127).to(torch.int8)
        back = dequantize_int8(stored, scale, mins if fmt.asym else None)
    return (stored, scale, mins), int((back != w).sum())
