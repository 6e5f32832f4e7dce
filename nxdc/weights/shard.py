"""Cut one rank's share out of a checkpoint tensor by the sharding role its layer declares
(``nxdc.model.sharding``: the layout and the roles).

Sources hand out ``LazyTensor``s; row-sharded weights (q/k/v/gate/up/lm_head) read only the
row range their rank needs (safetensors ``get_slice``, GGUF quantized rows), column-sharded
ones (o/down) read the tensor once and keep their columns. MoE experts shard like the MLP,
each expert over its own intermediate size; the router is replicated. Padding (heads, MLP
columns, vocabulary rows that the layout adds) is zeros, which adds exactly 0 to every output."""

from __future__ import annotations

from typing import Protocol

import torch

from nxdc.model.sharding import (
    EXPERT_COLS,
    EXPERT_ROWS,
    HEAD_COLS,
    KV_HEADS,
    MLP_COLS,
    MLP_ROWS,
    Q_HEADS,
    REPLICATED,
    VOCAB_ROWS,
    ShardLayout,
    expert_intermediate,
)
from nxdc.spec import ModelSpec


class LazyTensor(Protocol):
    shape: tuple[int, ...]

    def read(self, rows: slice | None = None) -> torch.Tensor:
        """Rows ``rows`` of dimension 0 (all of them by default), as a torch tensor."""
        ...


def _read(t: LazyTensor, a: int, b: int) -> torch.Tensor:
    """Rows a..b; an empty range (a rank of padding only) still yields the right dtype."""
    if a < b:
        return t.read(slice(a, b))
    return t.read(slice(0, 1))[:0]


def _rows_by_heads(t: LazyTensor, heads: tuple[int | None, ...], d: int) -> torch.Tensor:
    real = [h for h in heads if h is not None]
    # only the span of this rank's heads is read (nothing for a rank of padding heads only)
    a, b = (min(real) * d, (max(real) + 1) * d) if real else (0, 0)
    sub = _read(t, a, b)
    out = sub.new_zeros((len(heads) * d, *sub.shape[1:]))
    for i, h in enumerate(heads):
        if h is not None:
            out[i * d : (i + 1) * d] = sub[h * d - a : h * d - a + d]
    return out


def _cols_by_heads(w: torch.Tensor, heads: tuple[int | None, ...], d: int) -> torch.Tensor:
    # (any trailing dims ride along: a GGUF weight read with its scales and mins is [rows, K, 3])
    out = w.new_zeros((w.shape[0], len(heads) * d, *w.shape[2:]))
    for i, h in enumerate(heads):
        if h is not None:
            out[:, i * d : (i + 1) * d] = w[:, h * d : (h + 1) * d]
    return out


def _rows_range(t: LazyTensor, rank: int, per: int) -> torch.Tensor:
    total = t.shape[0]
    a, b = min(rank * per, total), min((rank + 1) * per, total)
    sub = _read(t, a, b)
    if b - a == per:
        return sub
    out = sub.new_zeros((per, *sub.shape[1:]))
    out[: b - a] = sub
    return out


def _cols_range(w: torch.Tensor, rank: int, per: int) -> torch.Tensor:
    total = w.shape[1]
    a, b = min(rank * per, total), min((rank + 1) * per, total)
    out = w.new_zeros((w.shape[0], per, *w.shape[2:]))
    out[:, : b - a] = w[:, a:b]
    return out


def rank_tensor(
    role: str, kind: str, t: LazyTensor, spec: ModelSpec, layout: ShardLayout, rank: int
) -> torch.Tensor:
    """Rank ``rank``'s share of a checkpoint tensor whose layer gives it the sharding ``role``
    (``model/sharding.py``); ``kind``: "weight", "bias", ..."""
    if layout.tp == 1 or role == REPLICATED:
        return t.read()
    d = spec.head_dim
    if role == Q_HEADS:
        return _rows_by_heads(t, layout.q_heads[rank], d)
    if role == KV_HEADS:
        return _rows_by_heads(t, layout.kv_heads[rank], d)
    if role in (MLP_ROWS, VOCAB_ROWS, EXPERT_ROWS):
        per = {MLP_ROWS: layout.intermediate, VOCAB_ROWS: layout.vocab}.get(role)
        return _rows_range(t, rank, per or expert_intermediate(spec, layout.tp))
    full = t.read()
    if kind == "bias":  # row-parallel: added once, by rank 0, before the all-reduce
        return full if rank == 0 else torch.zeros_like(full)
    if role == HEAD_COLS:
        return _cols_by_heads(full, layout.q_heads[rank], d)
    if role == MLP_COLS:
        return _cols_range(full, rank, layout.intermediate)
    if role == EXPERT_COLS:
        return _cols_range(full, rank, expert_intermediate(spec, layout.tp))
    raise ValueError(f"unknown sharding role {role!r}")


def tied_lm_head(embed: torch.Tensor, layout: ShardLayout, rank: int) -> torch.Tensor:
    """A tied lm_head's rows for ``rank``: a view of the embedding unless padding is needed."""
    per = layout.vocab
    a, b = min(rank * per, embed.shape[0]), min((rank + 1) * per, embed.shape[0])
    if b - a == per:
        return embed[a:b]
    out = embed.new_zeros((per, *embed.shape[1:]))  # also the int8 scale [vocab]
    out[: b - a] = embed[a:b]
    return out
