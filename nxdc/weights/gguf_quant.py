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
| Q4_K | nibble | 32: d·sc, −dmin·m | int4 asym g32, two-level scales |
| Q5_K | 5 bits | 32: d·sc, −dmin·m | int8 asym g32, two-level scales |
| Q6_K | 6 bits − 32 | 16: d·sc | int8 sym g16, two-level scales |

The first five store d and m as fp16, so nxdc keeps them as fp16 (its ``-f16`` formats). A
K-quant's d·sc (an fp16 times a 6-bit integer) needs up to 17 significant bits; nxdc keeps it as
the K-quant does (``-k``: an fp16 factor per 256 weights, an int8 factor per group), factored
back out of the group scales (``k_factors``), or, where a rank's cut or an embedding lookup rules
two-level scales out, as fp32 (``pipeline.kept_formats``).

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

from nxdc.model.quant import dequantize_int4, dequantize_int8, group_values, pack_int4, pack_two_level
from nxdc.model.weight_format import SUPER, WeightFormat

# GGUF type name -> (kind, inputs per scale, has a min, how scales and mins are stored)
KEPT = {
    "Q8_0": ("int8", 32, False, "f16"),
    "Q4_0": ("int4", 32, False, "f16"),
    "Q4_1": ("int4", 32, True, "f16"),
    "Q5_0": ("int8", 32, False, "f16"),
    "Q5_1": ("int8", 32, True, "f16"),
    "Q4_K": ("int4", 32, True, "k"),
    "Q5_K": ("int8", 32, True, "k"),
    "Q6_K": ("int8", 16, False, "k"),
}


def kept_format(type_name: str) -> WeightFormat | None:
    """The nxdc format that holds a GGUF type's values exactly; None if it is not kept."""
    k = KEPT.get(type_name)
    return WeightFormat(*k) if k else None


def common_format(formats: list[WeightFormat | None]) -> WeightFormat | None:
    """One format for a fused weight whose parts come as ``formats``: theirs where they agree,
    else int8 with the smallest group and a min if any part has one (int8 holds every kept type's
    q: nibbles, 5 and 6 bits; a sym part gets min 0, which adds exactly nothing), with the parts'
    scale storage where they share it, else fp32. None if a part is not kept (the weight is then
    stored dequantized)."""
    if any(f is None for f in formats):
        return None
    if len(set(formats)) == 1:
        return formats[0]
    scales = {f.scales for f in formats}
    return WeightFormat(
        "int8",
        min(f.group for f in formats),
        any(f.asym for f in formats),
        scales.pop() if len(scales) == 1 else "f32",
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
    """Group scales and mins ``[rows, groups]`` (fp32 values) as the format stores them: fp32,
    fp16 or two-level, each only where it gives the values back exactly (else AssertionError)."""
    if fmt.scales == "f32":
        return scale, mins
    if fmt.scales == "k":
        k = scale.shape[1] * fmt.group
        stored = (
            k_factors(scale, SUPER // fmt.group),
            (k_factors(mins, SUPER // fmt.group) if fmt.asym else mins),
        )
        back = group_values(stored[0], k), (group_values(stored[1], k) if fmt.asym else mins)
    else:
        stored = scale.half(), mins.half()
        back = stored[0].float(), stored[1].float()
    if not (torch.equal(back[0], scale) and torch.equal(back[1], mins)):
        raise AssertionError(f"{fmt.name}: GGUF scales or mins that {fmt.scales} storage does not hold")
    return stored


# The int8 factor of a super-block's largest group to try first: 63 (Q4_K / Q5_K's 6-bit scales and
# mins: llama.cpp maps the largest to 63), -128 and 127 (Q6_K's signed ones), then every other.
_FIRST = (63, -63, -128, 127)


def k_factors(v: torch.Tensor, gps: int) -> torch.Tensor:
    """Group values ``v [rows, groups]`` (fp32, each an fp16 times a small integer within its
    super-block of ``gps`` groups) -> the two-level layout ``uint8 [rows, 2 * super-blocks +
    groups]`` (``model/quant.py: group_values``); AssertionError if some super-block has no such
    factors. Any fp16 ``d`` and int8 ``c`` with ``d * c == v`` will do, so it tries ``d = v_max /
    c`` for the super-block's largest value and each ``c`` in turn, on the super-blocks not yet
    factored (a K-quant file's almost all take the first: llama.cpp maps the largest to 63 or -128)."""
    rows, ng = v.shape
    if ng % gps:
        raise AssertionError(f"{ng} groups a row: {SUPER}-weight super-blocks do not divide them")
    sb = v.reshape(-1, gps)
    top = sb.gather(-1, sb.abs().argmax(dim=-1, keepdim=True))
    d = torch.zeros_like(top)
    todo = (top[:, 0] != 0).nonzero()[:, 0]  # all-zero super-blocks: d = 0
    for c in [*_FIRST, *(c for c in range(-128, 128) if c and c not in _FIRST)]:
        if todo.numel() == 0:
            break
        part, cand = sb[todo], (top[todo] / c).half().float()
        f = part / torch.where(cand != 0, cand, torch.ones_like(cand))
        exact = (f == f.round()) & (f >= -128) & (f <= 127) & (cand * f == part)
        ok = (cand[:, 0] != 0) & exact.all(-1)
        d[todo[ok]] = cand[ok]
        todo = todo[~ok]
    if todo.numel():
        raise AssertionError(
            f"{todo.numel()} super-blocks of GGUF group scales without an fp16 x int8 factoring"
        )
    c = torch.where(d != 0, sb / torch.where(d != 0, d, torch.ones_like(d)), torch.zeros_like(sb))
    return pack_two_level(d.reshape(rows, ng // gps), c.reshape(rows, ng))


def _requantize_rows(w, s, m, fmt: WeightFormat, name: str) -> tuple[tuple[torch.Tensor, ...], int]:
    """``requantize`` of some rows: ``((q, scale, min), values not given back exactly)``."""
    n, k = w.shape
    g = fmt.group
    sg, mg = s.reshape(n, k // g, g), m.reshape(n, k // g, g)
    if not (torch.equal(sg, sg[..., :1].expand_as(sg)) and torch.equal(mg, mg[..., :1].expand_as(mg))):
        raise AssertionError(f"{name}: GGUF scales change within a {g}-weight group of {fmt.name}")
    values = sg[..., 0].contiguous(), mg[..., 0].contiguous()
    scale, mins = _stored_params(*values, fmt)  # checked: they hold ``values`` exactly
    sd = s.double()
    safe = torch.where(sd != 0, sd, torch.ones_like(sd))
    q = torch.round((w.double() - m.double()) / safe).where(sd != 0, torch.zeros_like(sd))
    if fmt.kind == "int4":
        q = q if fmt.asym else q + 8  # the stored nibble
        stored = pack_int4(q.clamp(0, 15).to(torch.uint8))
        back = dequantize_int4(stored, values[0], values[1] if fmt.asym else None)
    else:
        stored = q.clamp(-128, 127).to(torch.int8)
        back = dequantize_int8(stored, values[0], values[1] if fmt.asym else None)
    return (stored, scale, mins), int((back != w).sum())
