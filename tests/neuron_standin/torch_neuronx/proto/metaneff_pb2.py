"""CONTRACT STAND-IN for torch-neuronx's metaneff protobuf: what NxDModel.add reads from it
(input tensors with their type and checkpoint key, output tensors, output aliases, and the
graph in ``serialized_graph_def``), serialized as JSON."""

from __future__ import annotations

import base64
import json

from torch_neuronx._standin_pickle import NoPickle


class MetaTensor(NoPickle):
    class Type:
        USER_INPUT = 0
        INPUT_WEIGHT = 1
        INPUT_STATE = 2
        OUTPUT = 3

    def __init__(
        self, name="", type=0, shape=(), data_type="float32", checkpoint_key=b"", user_input_key=b""
    ):
        self.name, self.type, self.shape, self.data_type = name, type, list(shape), data_type
        self.checkpoint_key, self.user_input_key = checkpoint_key, user_input_key

    def to_dict(self):
        return {
            "name": self.name,
            "type": self.type,
            "shape": self.shape,
            "data_type": self.data_type,
            "checkpoint_key": self.checkpoint_key.decode(),
            "user_input_key": self.user_input_key.decode(),
        }

    @classmethod
    def from_dict(cls, d):
        return cls(
            d["name"],
            d["type"],
            d["shape"],
            d["data_type"],
            d["checkpoint_key"].encode(),
            d["user_input_key"].encode(),
        )


class MetaNeff(NoPickle):
    def __init__(self):
        self.input_tensors: list[MetaTensor] = []
        self.output_tensors: list[MetaTensor] = []
        self.output_aliases_to: dict[int, int] = {}
        self.serialized_graph_def = b""
        self.excluded_inputs: list[MetaTensor] = []  # stand-in only: user inputs the graph ignores
        self.folded: list[str] = []  # stand-in only: buffers baked into the graph as constants

    def SerializeToString(self) -> bytes:  # noqa: N802
        doc = {
            "input_tensors": [t.to_dict() for t in self.input_tensors],
            "output_tensors": [t.to_dict() for t in self.output_tensors],
            "output_aliases_to": {str(k): v for k, v in self.output_aliases_to.items()},
            "serialized_graph_def": base64.b64encode(self.serialized_graph_def).decode(),
            "excluded_inputs": [t.to_dict() for t in self.excluded_inputs],
            "folded": self.folded,
        }
        return b"STANDIN-METANEFF\n" + json.dumps(doc).encode()

    def ParseFromString(self, data: bytes) -> None:  # noqa: N802
        if not data.startswith(b"STANDIN-METANEFF\n"):
            raise ValueError("not a stand-in metaneff")
        doc = json.loads(data[len(b"STANDIN-METANEFF\n") :])
        self.input_tensors = [MetaTensor.from_dict(d) for d in doc["input_tensors"]]
        self.output_tensors = [MetaTensor.from_dict(d) for d in doc["output_tensors"]]
        self.output_aliases_to = {int(k): v for k, v in doc["output_aliases_to"].items()}
        self.serialized_graph_def = base64.b64decode(doc["serialized_graph_def"])
        self.excluded_inputs = [MetaTensor.from_dict(d) for d in doc["excluded_inputs"]]
        self.folded = doc["folded"]
