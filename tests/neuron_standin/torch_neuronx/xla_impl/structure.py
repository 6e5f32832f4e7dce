"""CONTRACT STAND-IN for torch-neuronx's input flattener and output packer, built from the same
arguments NxDModel.load rebuilds them with: ``Flattener(layout, exclude)``,
``Packer(layout, identifiers, constants)``."""

from __future__ import annotations

from torch_neuronx._standin_pickle import NoPickle


class Flattener(NoPickle):
    def __init__(self, layout, exclude):
        self.layout, self.exclude = layout, exclude

    def __call__(self, inputs):
        skip = set(self.exclude or ())
        return [inputs[i] for i in self.layout if i not in skip]


class Packer(NoPickle):
    """``layout``: an output index (one tensor) or a tuple of them."""

    def __init__(self, layout, identifiers, constants):
        self.layout, self.identifiers, self.constants = layout, identifiers, constants

    def __call__(self, outputs):
        if isinstance(self.layout, int):
            return outputs[self.layout]
        return tuple(outputs[i] for i in self.layout)
