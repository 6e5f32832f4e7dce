"""CONTRACT STAND-IN: ``xm.all_reduce`` as nxdc's tensor-parallel graphs call it under
``xla_collectives`` (NxD's parallel_layers/comm.py calls the same). It records the call and
lowers to a CPU op that sums over the stand-in device's rank threads."""

from __future__ import annotations

import torch
from torch_neuronx._standin_device import LOG, all_reduce_op  # noqa: F401  (registers the op)

REDUCE_SUM = "sum"


def all_reduce(reduce_type, inputs, scale=1.0, groups=None, pin_layout=True):
    if reduce_type != REDUCE_SUM:
        raise ValueError(f"stand-in all_reduce: only {REDUCE_SUM!r} (got {reduce_type!r})")
    if not isinstance(inputs, torch.Tensor):
        raise TypeError("stand-in all_reduce: one tensor")
    if not groups or len(groups) != 1:
        raise ValueError(f"stand-in all_reduce: one replica group of every rank (got {groups!r})")
    world = len(groups[0])
    LOG["all_reduce"].append({"groups": [list(g) for g in groups], "scale": scale})
    out = torch.ops.nxdc_standin.all_reduce(inputs, world)
    return out if scale == 1.0 else out * scale
