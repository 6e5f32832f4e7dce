"""CONTRACT STAND-IN for neuronx-cc (tests/neuron_standin/README.md). Like every stand-in
module, no ``__version__``: nxdc reads versions from package metadata."""
