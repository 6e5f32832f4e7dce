"""The collectives the tensor-parallel graphs call (functional: torch.export captures them);
how the model splits over ranks is ``nxdc.model.sharding``."""

from __future__ import annotations

import contextlib

import torch

_XLA_REPLICAS = False  # trace collectives as torch-xla all-reduces over one replica group


@contextlib.contextmanager
def xla_collectives():
    """Collectives traced as ``xm.all_reduce`` over the replica group of every rank: what NxD's
    ModelBuilder lowers into a NEFF (its own parallel layers call the same)."""
    global _XLA_REPLICAS
    _XLA_REPLICAS = True
    try:
        yield
    finally:
        _XLA_REPLICAS = False


def all_reduce(x: torch.Tensor, tp: int) -> torch.Tensor:
    if tp == 1:
        return x
    if _XLA_REPLICAS:
        import torch_xla.core.xla_model as xm

        return xm.all_reduce(xm.REDUCE_SUM, x, groups=[list(range(tp))])
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
