"""AWS Neuron backend (Trainium/Inferentia) through neuronx-distributed / torch-neuronx.

Those packages come only from AWS's own package repository; the PyPI projects with the same
names are empty placeholders. Without them this backend refuses with install instructions."""

from __future__ import annotations

import importlib.util

from nxdc.errors import UnsupportedError

REQUIRED = ("torch_neuronx", "neuronx_distributed", "libneuronxla")
INSTALL = (
    "install the AWS Neuron SDK from AWS's own package repository on a Trainium/Inferentia instance: "
    "pip install --extra-index-url https://pip.repos.neuron.amazonaws.com "
    "torch-neuronx neuronx-distributed libneuronxla (the PyPI packages of those names are placeholders)"
)


class NeuronBackend:
    name = "neuron"

    def __init__(self, device: str = "neuron"):
        missing = [m for m in REQUIRED if importlib.util.find_spec(m) is None]
        if missing:
            raise UnsupportedError(f"the neuron backend needs {', '.join(missing)}: {INSTALL}")
        raise UnsupportedError(
            "the neuron backend is recognised but compiling for Neuron is not implemented in this "
            "nxdc version; use --backend inductor"
        )
