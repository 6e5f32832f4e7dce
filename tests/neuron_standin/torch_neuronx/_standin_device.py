"""CONTRACT STAND-IN for the Neuron device runtime (``torch.classes.neuron.SPMDModel``): the
"NEFF" is a torch.export program, run on the CPU once per rank (one thread each), with
``nxdc_standin::all_reduce`` summing over the rank threads. It checks what the runtime would
need (every traced weight and state given for every rank, with its shape and dtype; inputs of
the traced dtypes and shapes); nothing about a Neuron device is exercised. ``LOG`` records the
calls for the test's assertions."""

from __future__ import annotations

import io
import threading
from collections import defaultdict

import torch

from torch_neuronx._standin_pickle import NoPickle

LOG: dict[str, list] = defaultdict(list)
NEFF_MAGIC = b"STANDIN-NEFF\n"
_LOCAL = threading.local()
_GROUP: _RankGroup | None = None


class _RankGroup:
    def __init__(self, world: int):
        self.world = world
        self.parts: list[torch.Tensor | None] = [None] * world
        self.barrier = threading.Barrier(world, timeout=120)

    def reduce(self, rank: int, x: torch.Tensor) -> torch.Tensor:
        self.parts[rank] = x.clone()
        self.barrier.wait()
        out = self.parts[0]
        for p in self.parts[1:]:
            out = out + p  # rank order: every rank gets the same bits
        self.barrier.wait()
        return out


@torch.library.custom_op("nxdc_standin::all_reduce", mutates_args=())
def all_reduce_op(x: torch.Tensor, world: int) -> torch.Tensor:
    group = _GROUP
    if group is None or group.world != world:
        raise RuntimeError(f"stand-in all_reduce over {world} ranks outside a {world}-rank device run")
    return group.reduce(_LOCAL.rank, x)


@all_reduce_op.register_fake
def _(x, world):
    return torch.empty_like(x)


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


class SPMDModel(NoPickle):
    """One NEFF on ``local_ranks`` ranks (stand-in for torch.classes.neuron.SPMDModel)."""

    def __init__(self, neff: bytes, metaneff_bytes: bytes, local_ranks: int, world_size: int):
        from torch_neuronx.proto import metaneff_pb2

        self.meta = metaneff_pb2.MetaNeff()
        self.meta.ParseFromString(metaneff_bytes)
        if not neff.startswith(NEFF_MAGIC) or neff[len(NEFF_MAGIC) :] != self.meta.serialized_graph_def:
            raise RuntimeError("stand-in SPMDModel: the NEFF was not compiled from this metaneff")
        self.local_ranks, self.world = local_ranks, world_size
        self.program = torch.export.load(io.BytesIO(self.meta.serialized_graph_def)).module()
        t = metaneff_pb2.MetaTensor.Type
        self.user = [m for m in self.meta.input_tensors if m.type == t.USER_INPUT]
        self.weights = [m for m in self.meta.input_tensors if m.type == t.INPUT_WEIGHT]
        self.states = [m for m in self.meta.input_tensors if m.type == t.INPUT_STATE]
        self.loaded = None

    def initialize(self, states: list[dict], weights: list[dict], start_rank: int) -> None:
        if len(weights) < self.local_ranks or len(states) < self.local_ranks:
            raise RuntimeError(
                f"stand-in SPMDModel: {len(weights)} ranks' weights for {self.local_ranks} ranks"
            )
        for rank in range(self.local_ranks):
            for kind, metas, given in (("weight", self.weights, weights), ("state", self.states, states)):
                for m in metas:
                    key = m.checkpoint_key.decode()
                    t = given[rank].get(key)
                    if t is None:
                        raise RuntimeError(f"stand-in SPMDModel: rank {rank} lacks {kind} {key}")
                    if list(t.shape) != m.shape or t.dtype != _dtype(m.data_type):
                        raise RuntimeError(
                            f"stand-in SPMDModel: rank {rank} {kind} {key} is {list(t.shape)} {t.dtype}, "
                            f"traced {m.shape} {m.data_type}"
                        )
        self.loaded = (states, weights, start_rank)
        LOG["initialize"].append({"ranks": self.local_ranks})

    def _inputs(self, flat: list[torch.Tensor]) -> list[torch.Tensor]:
        if len(flat) != len(self.user):
            raise RuntimeError(f"stand-in SPMDModel: {len(flat)} inputs, the NEFF takes {len(self.user)}")
        for t, m in zip(flat, self.user, strict=True):
            if list(t.shape) != m.shape or t.dtype != _dtype(m.data_type):
                raise RuntimeError(
                    f"stand-in SPMDModel: input {m.name} is {list(t.shape)} {t.dtype}, traced {m.shape} {m.data_type}"
                )
        # the graph ignores the excluded inputs: any value of their traced shape will do
        full = list(flat)
        for m in self.meta.excluded_inputs:
            full.insert(int(m.name), torch.zeros(m.shape, dtype=_dtype(m.data_type)))
        return full

    def _run_rank(self, rank: int, inputs, out: list) -> None:
        states, weights, _ = self.loaded
        _LOCAL.rank = rank
        given = {m.checkpoint_key.decode(): weights[rank][m.checkpoint_key.decode()] for m in self.weights}
        given.update(
            {m.checkpoint_key.decode(): states[rank][m.checkpoint_key.decode()] for m in self.states}
        )
        with torch.no_grad():
            res = torch.func.functional_call(self.program, given, tuple(inputs), strict=False)
        n_out = len(res) - len(self.states)
        for m, t in zip(self.states, res[n_out:], strict=True):  # aliased: written back in place
            states[rank][m.checkpoint_key.decode()].copy_(t)
        out[rank] = list(res[:n_out])

    def forward(self, flat: list[torch.Tensor]) -> list[torch.Tensor]:
        global _GROUP
        if self.loaded is None:
            raise RuntimeError("stand-in SPMDModel: not initialized (set_weights, then to_neuron)")
        inputs = self._inputs(flat)
        out: list = [None] * self.local_ranks
        if self.local_ranks == 1:
            self._run_rank(0, inputs, out)
            return out[0]
        _GROUP = _RankGroup(self.local_ranks)
        errors = []

        def run(rank):
            try:
                self._run_rank(rank, inputs, out)
            except BaseException as e:  # noqa: BLE001
                errors.append(e)
                _GROUP.barrier.abort()

        threads = [threading.Thread(target=run, args=(r,)) for r in range(self.local_ranks)]
        try:
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        finally:
            _GROUP = None
        if errors:
            raise errors[0]
        return out[0]  # default forward mode: rank 0's outputs
