"""Where each checkpoint tensor goes in the model, and how it shards: read off the layers.

nxdc stores some weights combined from several checkpoint tensors: a layer's q/k/v as one
``qkv_proj``, its gate/up as one ``gate_up_proj``, and a MoE layer's per-expert matrices
stacked as ``experts.gate_up_proj [E, 2*I, hidden]`` and ``experts.down_proj [E, hidden, I]``.
One matmul per group instead of three (two): fewer kernel calls per decode step, each streaming
a bigger matrix, one wider GEMM at prefill; stacked experts let one grouped GEMM serve every
expert (``model/moe.py``).

The layers say which checkpoint parts make a combined weight and each part's sharding role
(``Linear(parts=...)``, ``StackedWeight(parts=...)``; ``model/sharding.py``), and a plain weight's
role (``Linear(shard=...)``). ``checkpoint_targets`` turns that into one ``Target`` per
checkpoint name (in nxdc's module naming, as ``archs/`` maps it); the exporter cuts each
tensor by its role (``weights/shard.py``) and ``combine``s one rank's parts in index order:
concatenated along rows, then viewed as [E, rows, cols] for stacked experts."""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from nxdc.model.layers import Linear
from nxdc.model.moe import StackedWeight
from nxdc.model.sharding import REPLICATED, ShardLayout, role_rows
from nxdc.spec import ModelSpec


class Target(NamedTuple):
    stored: str  # the stored parameter
    role: str  # how this checkpoint tensor shards (model/sharding.py)
    index: int = 0  # position among the stored parameter's parts
    count: int = 1  # how many parts it has (1: stored as it is)
    experts: int = 0  # > 0: it stacks this many experts [experts, rows, cols]


def checkpoint_targets(model: nn.Module) -> dict[str, Target]:
    """{checkpoint name: Target} for every weight of ``model`` (a ``Decoder``, on any device)."""
    out: dict[str, Target] = {}
    for mod_name, mod in model.named_modules():
        prefix = f"{mod_name}." if mod_name else ""
        own = {n for n, _ in mod.named_parameters(recurse=False)}
        parts = getattr(mod, "parts", ())
        parent = mod_name.rpartition(".")[0]
        if isinstance(mod, StackedWeight):
            n = len(parts)
            for e in range(mod.experts):
                for i, p in enumerate(parts):
                    out[f"{parent}.{e}.{p.name}.weight"] = Target(
                        f"{prefix}weight", p.role, e * n + i, n * mod.experts, mod.experts
                    )
            continue
        for kind in sorted(own):
            if parts and kind in ("weight", "bias"):
                for i, p in enumerate(parts):
                    out[f"{parent}.{p.name}.{kind}"] = Target(f"{prefix}{kind}", p.role, i, len(parts))
            else:
                role = mod.shard if isinstance(mod, Linear) else REPLICATED
                out[f"{prefix}{kind}"] = Target(f"{prefix}{kind}", role)
    return out


def part_shape(
    target: Target, spec: ModelSpec, layout: ShardLayout, stored: tuple[int, ...]
) -> tuple[int, ...]:
    """One part's shape under ``layout`` (tp 1: the checkpoint's) of a stored shape ``stored``."""
    if target.experts:
        return (stored[1] // (target.count // target.experts), *stored[2:])
    if target.count > 1:
        return (role_rows(target.role, spec, layout), *stored[1:])
    return stored


def combine(target: Target, tensors: list[torch.Tensor]) -> torch.Tensor:
    """A stored weight's parts (in index order) -> the stored tensor."""
    out = torch.cat(tensors)
    return out.view(target.experts, -1, *out.shape[1:]) if target.experts else out


def fuse_state_dict(sd: dict, model: nn.Module) -> dict:
    """An unsharded state dict in checkpoint (part) names -> ``model``'s names, parts combined
    (tests and tools that load a model in-process; the exporter fuses per rank)."""
    targets = checkpoint_targets(model)
    out, parts = {}, {}
    for name, t in sd.items():
        f = targets.get(name)
        if f is None or f.count == 1:
            out[f.stored if f else name] = t
        else:
            parts.setdefault(f.stored, (f, {}))[1][f.index] = t
    for name, (f, got) in parts.items():
        out[name] = combine(f, [got[i] for i in sorted(got)])
    return out


def unfuse_state_dict(sd: dict, model: nn.Module) -> dict:
    """The inverse of ``fuse_state_dict`` for q/k/v and gate/up, on a tp 1 export's weights
    (checkpoint part names again: ``nxdc bench --compare transformers`` rebuilds the HF model)."""
    by_stored: dict[str, list[tuple[str, Target]]] = {}
    for name, t in checkpoint_targets(model).items():
        if t.count > 1 and not t.experts:
            by_stored.setdefault(t.stored, []).append((name, t))
    spec, tp1 = model.spec, model.layout
    out = {}
    for name, t in sd.items():
        parts = sorted(by_stored.get(name, []), key=lambda p: p[1].index)
        if not parts:
            out[name] = t
            continue
        rows = [role_rows(p.role, spec, tp1) for _, p in parts]
        for (part, _), piece in zip(parts, t.split(rows), strict=True):
            out[part] = piece
    return out
