"""CONTRACT STAND-IN for trace/nxd_model/nxd_model.py ``NxDModel`` (and base_nxd_model.py's
``StateInitializer``), with the rules of NxD 0.18's source:

- ``add`` asserts that every added model has the forward parameters of the first one (the
  assert in ``NxDModel.add``) and registers the model under a route key built from its traced
  argument names and shapes (``generate_route_key_from_provided_args``); several models may
  share a key, and then ``forward`` needs ``model_name``;
- ``add`` wants a tuple flattener layout (it asserts so) and reads the state shapes from the
  metaneff's INPUT_STATE tensors to build the default ``StateInitializer`` (zeros);
- ``set_weights`` takes one dict per rank before ``to_neuron``; ``forward`` refuses to run
  before ``to_neuron`` and returns rank 0's outputs through the packer."""

from __future__ import annotations

import torch
from torch_neuronx._standin_device import LOG, SPMDModel, _dtype
from torch_neuronx._standin_pickle import NoPickle
from torch_neuronx.proto import metaneff_pb2


class StateInitializer(NoPickle):
    def __init__(self, shapes, dtypes, local_ranks_size):
        self.shapes, self.dtypes, self.local_ranks_size = shapes, dtypes, local_ranks_size

    def __call__(self):
        return [
            {k: torch.zeros(s, dtype=self.dtypes[k]) for k, s in self.shapes.items()}
            for _ in range(self.local_ranks_size)
        ]


def route_key(provided_args) -> str:
    return "(" + ", ".join(f"{a.param_name}: {list(a.tensor.shape)}" for a in provided_args) + ")"


class NxDModel(NoPickle):
    def __init__(
        self,
        world_size,
        start_rank=None,
        local_ranks_size=None,
        state_initializer=None,
        layout_transformer=None,
    ):
        self.world_size = world_size
        self.start_rank = 0 if start_rank is None else start_rank
        self.local_ranks_size = world_size if local_ranks_size is None else local_ranks_size
        self.model_params = []
        self.input_shape_map: dict[str, list[str]] = {}
        self.spmd_models: dict[str, SPMDModel] = {}
        self.flattener_map, self.packer_map = {}, {}
        self.weights = [{}] * world_size
        self.states = [{}] * world_size
        self.state_initializer = state_initializer
        self.loaded_on_neuron = False
        LOG["nxd_model"].append({"world_size": world_size})

    def add(self, key, trace_artifacts, compilation_artifacts):
        metaneff = trace_artifacts.metaneff
        if self.state_initializer is None:
            shapes, dtypes = {}, {}
            for t in metaneff.input_tensors:
                if t.type == metaneff_pb2.MetaTensor.Type.INPUT_STATE:
                    k = t.checkpoint_key.decode()
                    shapes[k], dtypes[k] = list(t.shape), _dtype(t.data_type)
            if shapes:
                self.state_initializer = StateInitializer(shapes, dtypes, self.local_ranks_size)
        self.spmd_models[key] = SPMDModel(
            compilation_artifacts.get_neff_bytes(),
            metaneff.SerializeToString(),
            self.local_ranks_size,
            self.world_size,
        )
        if not self.model_params:
            self.model_params = trace_artifacts.model_params
        else:
            assert all(
                a == b for a, b in zip(self.model_params, trace_artifacts.model_params, strict=False)
            ), "The model provided appears to have a different signature than all other models added prior."
        flattener = trace_artifacts.flattener
        assert isinstance(flattener.layout, tuple), (
            f"Expected flattener layout type to be tuple but found {type(flattener.layout)}"
        )
        flattener.layout = list(flattener.layout)
        self.flattener_map[key] = flattener
        self.input_shape_map.setdefault(route_key(trace_artifacts.provided_args), []).append(key)
        self.packer_map[key] = trace_artifacts.packer
        LOG["add"].append({"key": key, "params": [p.param_name for p in trace_artifacts.model_params]})
        return self

    def set_weights(self, sharded_checkpoint):
        if self.loaded_on_neuron:
            raise ValueError("set_weights() was called when the model was already loaded on neuron.")
        if not isinstance(sharded_checkpoint, list) or len(sharded_checkpoint) != self.local_ranks_size:
            raise ValueError(f"stand-in set_weights: one dict per rank ({self.local_ranks_size})")
        for rank, sd in enumerate(sharded_checkpoint):
            off = [k for k, t in sd.items() if not isinstance(t, torch.Tensor) or t.device.type != "cpu"]
            if off:
                raise ValueError(f"stand-in set_weights: rank {rank}: {off[:3]} are not CPU tensors")
        self.weights = sharded_checkpoint
        LOG["set_weights"].append({"ranks": [dict(sd) for sd in sharded_checkpoint]})

    def to_neuron(self):
        if self.loaded_on_neuron:
            return
        if self.state_initializer is not None:
            self.states = self.state_initializer()
        for m in self.spmd_models.values():
            m.initialize(self.states, self.weights, self.start_rank)
        self.loaded_on_neuron = True

    def router(self, inputs, names):
        key = "(" + ", ".join(f"{n}: {list(t.shape)}" for n, t in zip(names, inputs, strict=False)) + ")"
        if key not in self.input_shape_map:
            raise KeyError(f"no model traced for inputs {key}")
        return self.input_shape_map[key]

    def forward(self, *args, model_name=None, forward_mode="default", **kwargs):
        if not self.loaded_on_neuron:
            raise RuntimeError("Model not initialized. Call set_weights() followed by to_neuron()")
        if forward_mode != "default" or kwargs:
            raise NotImplementedError("stand-in: nxdc calls forward positionally in default mode")
        names = [p.param_name for p in self.model_params][: len(args)]
        names_found = self.router(list(args), names)
        if len(names_found) > 1:
            assert model_name is not None, (
                f"Got {len(names_found)} possible routes but model_name wasn't provided."
            )
        else:
            assert model_name is None or model_name == names_found[0], "Provided model_name does not match"
            model_name = names_found[0]
        if model_name not in names_found:
            raise KeyError(f"{model_name} was not traced for these input shapes")
        LOG["forward"].append({"model_name": model_name, "dtypes": [a.dtype for a in args]})
        flat = self.flattener_map[model_name](list(args))
        return self.packer_map[model_name](self.spmd_models[model_name].forward(flat))

    __call__ = forward
