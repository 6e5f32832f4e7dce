"""The tensors of a GGUF file, found by walking its header with ``struct``.

``gguf.GGUFReader`` builds a numpy view for every metadata item, including each of the ~100k
strings of an embedded tokenizer: 4.8 s of SmolLM2's 9.4 s weight stage (most of a warm
export). Loading weights needs only the tensor table, so this walks the header once, skipping
metadata values by their lengths, and builds each tensor's data view exactly as
``GGUFReader._build_tensors`` does (gguf's own type table, ``quant_shape_to_byte_shape``);
dequantisation stays gguf's. Metadata (config, tokenizer) is still read with ``GGUFReader``,
once per file, by ``nxdc.weights.sources``."""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

# value type -> struct format of a scalar (8: string, 9: array)
_SCALAR = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_PLAIN = {"F16": np.float16, "F32": np.float32, "F64": np.float64, "I8": np.int8, "I16": np.int16,
          "I32": np.int32, "I64": np.int64}  # fmt: skip


@dataclass
class IndexedTensor:
    name: str
    tensor_type: object  # gguf.GGMLQuantizationType
    shape: np.ndarray  # GGUF order (innermost first), as GGUFReader's ``shape``
    data: np.ndarray  # a memmap view, as GGUFReader's ``data``


class _Cursor:
    """Reads GGUF's little-endian header fields in order."""

    def __init__(self, buf: memoryview, pos: int = 0):
        self.buf, self.pos = buf, pos

    def take(self, fmt: str):
        v = struct.unpack_from("<" + fmt, self.buf, self.pos)
        self.pos += struct.calcsize("<" + fmt)
        return v[0]

    def string(self) -> bytes:
        n = self.take("Q")
        self.pos += n
        return bytes(self.buf[self.pos - n : self.pos])

    def skip(self, vtype: int) -> None:
        """Step over one metadata value of type ``vtype``."""
        if vtype == 8:
            n = self.take("Q")  # (not `pos += take(...)`: that reads pos before take moves it)
            self.pos += n
        elif vtype == 9:
            itype, count = self.take("I"), self.take("Q")
            if itype in _SCALAR:
                self.pos += struct.calcsize("<" + _SCALAR[itype]) * count
            else:
                for _ in range(count):
                    self.skip(itype)
        else:
            self.pos += struct.calcsize("<" + _SCALAR[vtype])


def _tensor_infos(path: Path, c: _Cursor) -> tuple[list[tuple[str, list[int], int, int]], int]:
    """Every tensor's (name, dims, type, offset) and where the tensor data starts."""
    from gguf.constants import GGMLQuantizationType

    if bytes(c.buf[:4]) != b"GGUF":
        raise ValueError(f"{path} is not a GGUF file")
    c.pos = 4
    version, n_tensors, n_kv = c.take("I"), c.take("Q"), c.take("Q")
    if version < 2:
        raise ValueError(f"{path}: GGUF version {version} is not supported")
    alignment = 32
    for _ in range(n_kv):
        key, vtype = c.string(), c.take("I")
        if key == b"general.alignment" and vtype == 4:
            alignment = c.take("I")
        else:
            c.skip(vtype)
    infos = []
    for _ in range(n_tensors):
        name = c.string().decode()
        dims = [c.take("Q") for _ in range(c.take("I"))]
        infos.append((name, dims, GGMLQuantizationType(c.take("I")), c.take("Q")))
    return infos, -(-c.pos // alignment) * alignment


def release(view: np.ndarray) -> None:
    """Drop the whole pages under ``view`` (a slice of a file ``read_index`` mapped) from this
    process's resident set; touched again, they come back from the page cache. Otherwise every
    source tensor an export has converted stays counted in its RSS to the end (an 8B Q4_K_M
    file: 4.2 GB)."""
    root = view
    while isinstance(root.base, np.ndarray):
        root = root.base
    mm = root.base
    if not isinstance(mm, mmap.mmap) or not hasattr(mm, "madvise") or not hasattr(mmap, "MADV_DONTNEED"):
        return
    page = mmap.PAGESIZE
    start = view.ctypes.data - root.ctypes.data
    lo, hi = -(-start // page) * page, (start + view.nbytes) // page * page
    if hi > lo:
        mm.madvise(mmap.MADV_DONTNEED, lo, hi - lo)


def read_index(path: Path) -> list[IndexedTensor]:
    from gguf.constants import GGML_QUANT_SIZES
    from gguf.quants import quant_shape_to_byte_shape

    mm = np.memmap(path, dtype=np.uint8, mode="r")
    infos, start = _tensor_infos(path, _Cursor(memoryview(mm)))
    out = []
    for name, dims, qtype, offset in infos:
        n_elems = int(np.prod(dims))
        block, size = GGML_QUANT_SIZES[qtype]
        np_dims = tuple(reversed(dims))
        if qtype.name in _PLAIN:
            item, count = _PLAIN[qtype.name], n_elems
        else:
            item, count = np.uint8, n_elems * size // block
            np_dims = quant_shape_to_byte_shape(np_dims, qtype)
        at = start + offset
        nbytes = count * np.dtype(item).itemsize
        data = mm[at : at + nbytes].view(item).reshape(np_dims)
        out.append(IndexedTensor(name, qtype, np.array(dims, dtype=np.uint64), data))
    return out
