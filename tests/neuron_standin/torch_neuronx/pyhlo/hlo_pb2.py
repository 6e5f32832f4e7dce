"""CONTRACT STAND-IN for torch-neuronx's HLO protobuf: the "HLO" is a serialized torch.export
program (bytes)."""

from torch_neuronx._standin_pickle import NoPickle


class HloModuleProto(NoPickle):
    def __init__(self, program: bytes = b""):
        self.program = program

    def SerializeToString(self) -> bytes:  # noqa: N802 (protobuf's name)
        return b"STANDIN-HLO\n" + self.program

    def ParseFromString(self, data: bytes) -> None:  # noqa: N802
        if not data.startswith(b"STANDIN-HLO\n"):
            raise ValueError("not a stand-in HLO module")
        self.program = data[len(b"STANDIN-HLO\n") :]
