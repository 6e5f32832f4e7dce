"""Tensors from a Hugging Face directory: one or many safetensors files (with index)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from nxdc.errors import UserInputError


def safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [path / n for n in names]
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        raise UserInputError(f"{path}: no *.safetensors weights (pytorch_model.bin is not supported)")
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise UserInputError(f"{path}: weight files listed in the index are missing: {', '.join(missing)}")
    return files


class SafetensorsTensor:
    """One tensor of an open safetensors file, read on demand (rows via ``get_slice``: only
    those bytes are read). Valid until the iterator that made it moves on."""

    def __init__(self, st, name: str):
        self._slice = st.get_slice(name)
        self.shape = tuple(self._slice.get_shape())

    def read(self, rows: slice | None = None) -> torch.Tensor:
        return self._slice[:] if rows is None else self._slice[rows]


def iter_safetensors(path: Path) -> Iterator[tuple[str, SafetensorsTensor]]:
    for f in safetensors_files(path):
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():
                yield name, SafetensorsTensor(st, name)
