"""Tensors, config and names from a GGUF file (dequantized with the ``gguf`` package).

llama.cpp's converter permutes the q/k projection rows for its rotary layout; we undo it so
the weights match the Hugging Face checkpoint the GGUF was made from."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from nxdc.errors import UnsupportedError, UserInputError

_LAYER = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_SKIP = {"rope_freqs"}  # recomputed from the config


def gguf_config(path: Path) -> dict[str, Any]:
    """The Hugging Face config for a GGUF file, as transformers maps its metadata."""
    from transformers import AutoConfig

    try:
        cfg = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    except ValueError as e:
        raise UnsupportedError(f"{path.name}: {e}") from e
    except Exception as e:
        raise UserInputError(f"{path.name} is not a readable GGUF file: {e}") from e
    return cfg.to_dict()


def hf_name(gguf_name: str) -> str | None:
    base, _, suffix = gguf_name.rpartition(".")
    if base in _SKIP:
        return None
    if base in _GLOBAL:
        return f"{_GLOBAL[base]}.{suffix}"
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)", base)
    if m and m.group(2) in _LAYER:
        return f"model.layers.{m.group(1)}.{_LAYER[m.group(2)]}.{suffix}"
    return None


def unpermute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


def iter_gguf(path: Path, spec) -> Iterator[tuple[str, torch.Tensor]]:
    from gguf import GGUFReader
    from gguf.quants import dequantize

    reader = GGUFReader(path)
    for t in reader.tensors:
        name = hf_name(t.name)
        if name is None:
            continue
        data = dequantize(t.data, t.tensor_type)
        shape = tuple(int(s) for s in reversed(t.shape))
        arr = np.ascontiguousarray(data).reshape(shape)
        w = torch.from_numpy(arr if arr.flags.writeable else arr.copy())
        if name.endswith("q_proj.weight"):
            w = unpermute(w, spec.num_heads)
        elif name.endswith("k_proj.weight"):
            w = unpermute(w, spec.num_kv_heads)
        yield name, w
