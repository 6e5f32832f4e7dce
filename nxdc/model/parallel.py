"""The collectives the tensor-parallel graphs call (functional: torch.export captures them);
how the model splits over ranks is ``nxdc.model.sharding``."""

from __future__ import annotations

import torch


def all_reduce(x: torch.Tensor, tp: int) -> torch.Tensor:
    if tp == 1:
        return x
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    return funcol.all_reduce(x, "sum", dist.group.WORLD)


def all_gather_last(x: torch.Tensor, tp: int, rank: torch.Tensor) -> torch.Tensor:
    """Concatenate every rank's ``x`` along the last dimension (rank order).

    Built from an all-reduce (each rank contributes its part at its own offset, zeros
    elsewhere: the sum is exact), not ``all_gather_into_tensor``: that op has an autograd
    kernel written in Python, so AOTInductor's proxy executor hands its tensors to Python;
    gloo's thread then frees them needing the GIL, which the next graph call holds while it
    waits for that thread — a deadlock, seen as an occasional hang. ``rank`` is an int64
    ``[1]`` constant each rank binds to its own index (the graph is the same on every rank)."""
    if tp == 1:
        return x
    mine = (torch.arange(tp, device=x.device) == rank).view(*([1] * (x.dim() - 1)), tp, 1)
    parts = torch.where(mine, x.unsqueeze(-2), torch.zeros((), dtype=x.dtype, device=x.device))
    return all_reduce(parts, tp).flatten(-2)
