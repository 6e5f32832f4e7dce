"""CONTRACT STAND-IN for the part of torch-xla that nxdc's traced collectives call
(tests/neuron_standin/README.md)."""
