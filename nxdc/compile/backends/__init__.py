"""Compile backends. ``inductor`` (torch.export + AOTInductor, CPU or CUDA) is the default;
``neuron`` is recognised and refused with install instructions where its SDK is absent."""

from __future__ import annotations

from nxdc.errors import UnsupportedError, UserInputError


def get_backend(name: str, device: str = "cpu"):
    if name == "inductor":
        from nxdc.compile.backends.inductor import InductorBackend

        return InductorBackend(device)
    if name == "neuron":
        from nxdc.compile.backends.neuron import NeuronBackend

        return NeuronBackend(device)
    raise UserInputError(f"unknown backend {name!r} (known: inductor, neuron)")


def check_device(device: str) -> str:
    import torch

    if device == "cpu":
        return device
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise UnsupportedError(f"--device {device}: no CUDA device is available on this machine")
        return device
    raise UserInputError(f"--device must be cpu or cuda[:N] (got {device!r})")
