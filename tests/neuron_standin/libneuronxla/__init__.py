"""CONTRACT STAND-IN for libneuronxla (tests/neuron_standin/README.md)."""
