"""CONTRACT STAND-IN for trace/parallel_context.py ``NxDParallelState``: records the parallel
state that tracing runs under (world size, tensor-parallel size, logical NeuronCore size)."""

from __future__ import annotations

_CURRENT: list[dict] = []


def current() -> dict | None:
    return _CURRENT[-1] if _CURRENT else None


class NxDParallelState:
    def __init__(
        self,
        world_size=1,
        rank=0,
        tensor_model_parallel_size=1,
        pipeline_model_parallel_size=1,
        context_parallel_size=1,
        expert_model_parallel_size=1,
        lnc_size=None,
    ):
        if world_size % tensor_model_parallel_size:
            raise ValueError(f"world_size {world_size} is not a multiple of tp {tensor_model_parallel_size}")
        self.state = {
            "world_size": world_size,
            "tensor_model_parallel_size": tensor_model_parallel_size,
            "lnc_size": 1 if lnc_size is None else lnc_size,
        }

    def __enter__(self):
        _CURRENT.append(self.state)
        return self

    def __exit__(self, *exc):
        _CURRENT.pop()
