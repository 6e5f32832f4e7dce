"""Tensor parallelism: how a decoder's heads, MLP and vocabulary split over ``tp`` ranks (no
torch here: plans and the serve process read it; the collectives are in ``parallel``).

Every rank runs the same graph (SPMD): q/k/v/gate/up are column-parallel (each rank owns some
output rows), o/down are row-parallel (each rank owns the matching input columns; their partial
sums meet in one all-reduce), the lm_head is vocab-parallel (logits all-gathered), the embedding
and norms are replicated (an embedding lookup reads only the batch's rows; sharding it would
cost an all-reduce per step to save memory that a decode step never streams).

Heads. A rank's query heads must attend through KV heads the rank holds, and every rank must
hold the same number of each. With H query heads, K KV heads (group G = H/K) and degree t:
- ``split``: t divides K: K/t KV heads per rank, with their whole query groups;
- ``replicate``: each KV head is copied f = lcm(K, t)/K times, its G query heads dealt out over
  the copies (a group that f does not divide is padded with zero heads);
- ``pad``: dummy KV groups (zero weights) bring K up to a multiple of t.
The cheaper of ``replicate`` and ``pad`` is chosen (fewest heads per rank). Padded query heads
have zero q rows and zero o_proj columns, so they add exactly 0 to the output; padded KV heads
only serve padded query heads. The MLP's intermediate size and the vocabulary are padded with
zero rows to a multiple of t the same way.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from nxdc.spec import ModelSpec

Heads = tuple[tuple[int | None, ...], ...]  # per rank: original head index or None (padding)


@dataclass(frozen=True)
class ShardLayout:
    tp: int
    strategy: str  # "none" | "split" | "replicate" | "pad"
    q_heads: Heads  # per rank, in the rank's local order
    kv_heads: Heads
    intermediate: int  # per rank (padded total = tp * intermediate)
    vocab: int  # lm_head rows per rank (padded total = tp * vocab)

    @property
    def heads(self) -> int:
        return len(self.q_heads[0])

    @property
    def kv(self) -> int:
        return len(self.kv_heads[0])

    @property
    def padded(self) -> bool:
        return any(h is None for r in self.q_heads + self.kv_heads for h in r)

    def describe(self, spec: ModelSpec) -> str:
        h, k = spec.num_heads, spec.num_kv_heads
        if self.tp == 1:
            return "no sharding (tp 1)"
        total_q, total_kv = self.tp * self.heads, self.tp * self.kv
        text = {
            "split": f"{k} KV heads split {self.kv} per rank with their query groups",
            "replicate": f"{k} KV heads replicated to {total_kv} ({self.kv} per rank)",
            "pad": f"{k} KV heads padded to {total_kv} with zero heads ({self.kv} per rank)",
        }[self.strategy]
        if total_q != h:
            text += f"; {h} query heads padded to {total_q} ({self.heads} per rank)"
        else:
            text += f"; {self.heads} query heads per rank"
        return text


def _layout_split(h: int, k: int, t: int) -> tuple[list[int | None], list[list[int | None]]]:
    g = h // k
    kv = list(range(k))
    return kv, [[j * g + i for i in range(g)] for j in kv]


def _layout_replicate(h: int, k: int, t: int):
    g_full = h // k
    f = math.lcm(k, t) // k
    g = -(-g_full // f)
    kv, groups = [], []
    for j in range(k):
        for c in range(f):
            kv.append(j)
            groups.append([j * g_full + c * g + i if c * g + i < g_full else None for i in range(g)])
    return kv, groups


def _layout_pad(h: int, k: int, t: int):
    g = h // k
    total = -(-k // t) * t
    kv = [j if j < k else None for j in range(total)]
    return kv, [[j * g + i if j < k else None for i in range(g)] for j in range(total)]


def shard_layout(spec: ModelSpec, tp: int) -> ShardLayout:
    """The per-rank split of ``spec`` at degree ``tp``; callers validate ``tp`` first
    (``check_tp``)."""
    h, k = spec.num_heads, spec.num_kv_heads
    if k % tp == 0:
        strategy, (kv, groups) = ("none" if tp == 1 else "split"), _layout_split(h, k, tp)
    else:
        options = {"replicate": _layout_replicate(h, k, tp), "pad": _layout_pad(h, k, tp)}
        strategy = min(
            options, key=lambda s: (len(options[s][0]) * (1 + len(options[s][1][0])), s != "replicate")
        )
        kv, groups = options[strategy]
    per = len(kv) // tp
    q_heads = tuple(tuple(q for grp in groups[r * per : (r + 1) * per] for q in grp) for r in range(tp))
    kv_heads = tuple(tuple(kv[r * per : (r + 1) * per]) for r in range(tp))
    return ShardLayout(
        tp=tp,
        strategy=strategy,
        q_heads=q_heads,
        kv_heads=kv_heads,
        intermediate=-(-spec.intermediate_size // tp),
        vocab=-(-spec.vocab_size // tp),
    )


def unpadded_degrees(spec: ModelSpec, up_to: int) -> list[int]:
    """Degrees <= up_to that shard heads, MLP and vocabulary with no padding at all."""
    out = []
    for t in range(1, up_to + 1):
        lay = shard_layout(spec, t)
        if (
            not lay.padded
            and spec.intermediate_size % t == 0
            and spec.vocab_size % t == 0
            and t * lay.heads == spec.num_heads
        ):
            out.append(t)
    return out


def check_tp(spec: ModelSpec, tp: int) -> str | None:
    """Why ``tp`` cannot shard ``spec`` (None when it can)."""
    if tp > spec.num_heads:
        ok = unpadded_degrees(spec, spec.num_heads)
        return (
            f"--tp {tp} exceeds the model's {spec.num_heads} attention heads (ranks would hold only "
            f"padding); degrees that shard it without padding: {', '.join(map(str, ok))}"
        )
    return None


def expert_intermediate(spec: ModelSpec, tp: int) -> int:
    """One rank's share of each expert's intermediate size (zero-padded to a multiple of tp)."""
    return -(-spec.moe_intermediate_size // tp)


# --- sharding roles: the layers declare them, the exporter cuts each weight by its role ------
REPLICATED = "replicated"  # embedding, norms, router: every rank holds all of it
Q_HEADS = "q_heads"  # column-parallel, output rows by this rank's query heads (q)
KV_HEADS = "kv_heads"  # column-parallel, output rows by this rank's KV heads (k, v)
MLP_ROWS = "mlp_rows"  # column-parallel, output rows by MLP intermediate (gate, up)
VOCAB_ROWS = "vocab_rows"  # vocab-parallel lm_head rows
HEAD_COLS = "head_cols"  # row-parallel, input columns by query heads (o); bias on rank 0 only
MLP_COLS = "mlp_cols"  # row-parallel, input columns by MLP intermediate (down); bias on rank 0
EXPERT_ROWS = "expert_rows"  # each expert's gate / up rows over the expert intermediate
EXPERT_COLS = "expert_cols"  # each expert's down columns over the expert intermediate


@dataclass(frozen=True)
class Part:
    """One checkpoint tensor of a weight nxdc stores combined (q of qkv_proj, ...): its name in
    the checkpoint's module (``q_proj``) and its sharding role."""

    name: str
    role: str


def role_rows(role: str, spec: ModelSpec, layout: ShardLayout) -> int:
    """Output rows one rank holds of a column-parallel part."""
    return {
        Q_HEADS: layout.heads * spec.head_dim,
        KV_HEADS: layout.kv * spec.head_dim,
        MLP_ROWS: layout.intermediate,
        EXPERT_ROWS: expert_intermediate(spec, layout.tp),
    }[role]
