"""CONTRACT STAND-IN for torch-neuronx (tests/neuron_standin/README.md): its protobufs
(``proto.metaneff_pb2``, ``pyhlo.hlo_pb2``), its flattener / packer (``xla_impl.structure``) and,
in ``_standin_device``, a CPU stand-in for the device runtime (``torch.classes.neuron.SPMDModel``)."""
