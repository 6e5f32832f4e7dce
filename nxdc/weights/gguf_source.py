"""Tensors, config and names from a GGUF file (dequantized with the ``gguf`` package).

llama.cpp's converter permutes the q/k projection rows for its rotary layout; we undo it so
the weights match the Hugging Face checkpoint the GGUF was made from."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from nxdc.archs import get_arch
from nxdc.cache.keys import digest
from nxdc.cache.store import default_root
from nxdc.errors import UnsupportedError, UserInputError
from nxdc.weights.gguf_index import read_index, release
from nxdc.weights.gguf_quant import CHUNK_WEIGHTS, expanded_params


def converted_metadata(path: Path, cache_root: Path | None = None) -> Path:
    """A directory with ``config.json`` and the tokenizer files that transformers converts from
    a GGUF file's metadata. Converting parses the whole file in Python (~3 s each for config
    and tokenizer), which would dominate a warm export, so the result is kept in
    ``<cache>/sources/`` keyed by the file's identity (path, size, mtime) and the transformers
    version, written to a temp dir and renamed into place."""
    import shutil
    import tempfile
    from importlib.metadata import version

    st = path.stat()
    key = digest(
        ["gguf-metadata", 1, str(path.resolve()), st.st_size, st.st_mtime_ns, version("transformers")]
    )
    d = (cache_root or default_root()) / "sources" / key[:24]
    if (d / "config.json").is_file():
        return d
    from transformers import AutoConfig, AutoTokenizer  # ~1 s to import: only when converting

    d.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=d.parent))
    try:
        try:
            cfg = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
            tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        except ValueError as e:
            raise UnsupportedError(f"{path.name}: {e}") from e
        except Exception as e:
            raise UserInputError(f"{path.name} is not a readable GGUF file: {e}") from e
        tok.save_pretrained(tmp)
        (tmp / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2, default=str))
        try:
            os.rename(tmp, d)
        except OSError:  # another export converted it meanwhile
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return d


def unpermute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


class GGUFTensor:
    """One GGUF tensor, dequantized on demand: a row range dequantizes only those rows (GGUF
    quantizes along rows). q/k rows are un-permuted per head, so row ranges of q/k must cover
    whole heads."""

    def __init__(self, t, head_rows: int | None):
        self._t = t
        self.shape = tuple(int(s) for s in reversed(t.shape))
        self._head_rows = head_rows  # head_dim for q/k projections (to un-permute), else None

    @property
    def type_name(self) -> str:
        return self._t.tensor_type.name

    def with_params(self) -> GGUFTensor:
        """This tensor, read as ``[rows, K, 3]``: each weight's value, scale and min
        (``gguf_quant``: how a kept type's bits travel through sharding)."""
        view = GGUFTensor(self._t, self._head_rows)
        view._params = True
        return view

    _params = False

    def read(self, rows: slice | None = None) -> torch.Tensor:
        from gguf.quants import dequantize

        rows = rows or slice(0, self.shape[0])
        a, b, _ = rows.indices(self.shape[0])
        data = self._t.data if len(self.shape) == 1 else self._t.data[a:b]
        if self._params:
            arr = self._with_params(np.asarray(data))
        else:
            arr = np.ascontiguousarray(dequantize(data, self._t.tensor_type))
            arr = arr.reshape(self.shape if len(self.shape) == 1 else (b - a, *self.shape[1:]))
        w = torch.from_numpy(arr if arr.flags.writeable else arr.copy())
        if len(self.shape) > 1:
            release(data)  # converted: its source pages need not stay resident
        if self._head_rows:
            if a % self._head_rows or b % self._head_rows:
                raise ValueError(f"{self._t.name}: rows {a}:{b} split a head")
            w = unpermute(w, (b - a) // self._head_rows)
        return w

    def _with_params(self, data: np.ndarray) -> np.ndarray:
        """Raw rows -> ``[rows, K, 3]`` fp32 (value, scale, min), filled ~4M weights at a time
        (whole-tensor temporaries held an 8B embedding's values four times over: 3.2 GB)."""
        from gguf.quants import dequantize

        k = self.shape[1]
        out = np.empty((data.shape[0], k, 3), np.float32)
        step = max(1, CHUNK_WEIGHTS // k)
        for r in range(0, data.shape[0], step):
            part = data[r : r + step]
            out[r : r + step, :, 0] = dequantize(part, self._t.tensor_type).reshape(-1, k)
            out[r : r + step, :, 1], out[r : r + step, :, 2] = expanded_params(self.type_name, part, k)
        return out


def iter_gguf(path: Path, spec) -> Iterator[tuple[str, GGUFTensor]]:
    """(checkpoint name, tensor) for every weight of the file, named as the architecture's HF
    checkpoints name them (``archs/``: ``gguf_name``)."""
    arch = get_arch(spec.arch)
    for t in read_index(path):  # the tensor table only: ~0.03 s where GGUFReader takes seconds
        name = arch.gguf_name(t.name)
        if name is None:
            continue
        yield name, GGUFTensor(t, spec.head_dim if arch.gguf_permuted(name) else None)
