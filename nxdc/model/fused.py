"""Weights nxdc stores combined from several checkpoint tensors: a layer's q/k/v as one
``qkv_proj``, its gate/up as one ``gate_up_proj``, and a MoE layer's per-expert matrices
stacked as ``experts.gate_up_proj [E, 2*I, hidden]`` and ``experts.down_proj [E, hidden, I]``.

One matmul per group instead of three (two): a SmolLM2 decode step makes 90 fewer kernel calls,
each streams a bigger matrix, and prefill runs one wider GEMM; stacked experts let one
grouped GEMM serve every expert (``model/moe.py``). Checkpoints name the parts; the exporter
shards each part by its own rule (``nxdc.weights.shard``: per head, per MLP column) and
``combine``s one rank's parts in index order: concatenated along rows, then viewed as
[E, rows, cols] for stacked experts. So the split sizes in the model are that rank's part
sizes."""

from __future__ import annotations

import re
from typing import NamedTuple

import torch

from nxdc.model.parallel import ShardLayout
from nxdc.spec import ModelSpec

# fused module (last two name components) -> its parts, in concatenation order
GROUPS = {
    ("self_attn", "qkv_proj"): ("q_proj", "k_proj", "v_proj"),
    ("mlp", "gate_up_proj"): ("gate_proj", "up_proj"),
}
# stacked expert weight -> each expert's parts, in order (expert e's parts come before e+1's)
EXPERT_GROUPS = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}
_EXPERT_PART = re.compile(r"(?P<parent>.*\.experts)\.(?P<e>\d+)\.(?P<leaf>\w+)\.(?P<kind>\w+)")


class Part(NamedTuple):
    target: str  # the stored parameter
    index: int  # position among the target's parts
    count: int  # how many parts the target has
    experts: int = 0  # > 0: the target stacks this many experts [experts, rows, cols]


def fused_target(name: str, num_experts: int = 0) -> Part | None:
    """``layers.3.self_attn.k_proj.weight`` -> (``layers.3.self_attn.qkv_proj.weight``, 1, 3);
    ``layers.3.mlp.experts.5.up_proj.weight`` -> (``layers.3.mlp.experts.gate_up_proj.weight``,
    11, 2 * num_experts, num_experts); None for a weight that is stored as it is."""
    m = _EXPERT_PART.fullmatch(name)
    if m:
        for target, parts in EXPERT_GROUPS.items():
            if m["leaf"] in parts:
                e, n = int(m["e"]), len(parts)
                return Part(
                    f"{m['parent']}.{target}.{m['kind']}",
                    e * n + parts.index(m["leaf"]),
                    n * num_experts,
                    num_experts,
                )
        return None
    module, _, kind = name.rpartition(".")
    parent, _, leaf = module.rpartition(".")
    block = parent.rpartition(".")[2]
    for (fblock, fleaf), parts in GROUPS.items():
        if block == fblock and leaf in parts:
            return Part(f"{parent}.{fleaf}.{kind}", parts.index(leaf), len(parts))
    return None


def part_shape(spec: ModelSpec, layout: ShardLayout, name: str, stored: tuple[int, ...]) -> tuple[int, ...]:
    """The shape of one rank's part ``name`` of a stored tensor of shape ``stored``."""
    part = fused_target(name, spec.num_experts)
    if part is not None and part.experts:
        per_expert = part.count // part.experts
        return (stored[1] // per_expert, *stored[2:])
    return (part_rows(spec, layout, name), *stored[1:])


def part_rows(spec: ModelSpec, layout: ShardLayout, name: str) -> int:
    """Output rows of one rank's part ``name`` (a q/k/v/gate/up weight or bias)."""
    leaf = name.rpartition(".")[0].rpartition(".")[2]
    if leaf == "q_proj":
        return layout.heads * spec.head_dim
    if leaf in ("k_proj", "v_proj"):
        return layout.kv * spec.head_dim
    return layout.intermediate


def combine(part: Part, tensors: list[torch.Tensor]) -> torch.Tensor:
    """A target's parts (in index order) -> the stored tensor."""
    out = torch.cat(tensors)
    return out.view(part.experts, -1, *out.shape[1:]) if part.experts else out


def fuse_state_dict(sd: dict, num_experts: int = 0) -> dict:
    """An unsharded state dict in checkpoint (part) names -> nxdc's names, parts combined
    (tests and tools that load a model in-process; the exporter fuses per rank)."""
    out, parts = {}, {}
    for name, t in sd.items():
        f = fused_target(name, num_experts)
        if f is None:
            out[name] = t
        else:
            parts.setdefault(f.target, (f, {}))[1][f.index] = t
    for name, (f, got) in parts.items():
        out[name] = combine(f, [got[i] for i in sorted(got)])
    return out


def unfuse_state_dict(sd: dict, spec: ModelSpec) -> dict:
    """The inverse of ``fuse_state_dict`` for q/k/v and gate/up, on a tp 1 export's weights
    (checkpoint part names again: ``nxdc bench --compare transformers`` rebuilds the HF model)."""
    from nxdc.model.parallel import shard_layout

    tp1 = shard_layout(spec, 1)
    out = {}
    for name, t in sd.items():
        module, _, kind = name.rpartition(".")
        parent, _, leaf = module.rpartition(".")
        parts = GROUPS.get((parent.rpartition(".")[2], leaf))
        if parts is None:
            out[name] = t
            continue
        names = [f"{parent}.{p}.{kind}" for p in parts]
        for part, piece in zip(names, t.split([part_rows(spec, tp1, n) for n in names]), strict=True):
            out[part] = piece
    return out
