"""The stand-in's objects refuse pickling: the real ones are closed-source torch-neuronx objects
(pybind / protobuf) that nxdc must persist through the supported routes."""


class NoPickle:
    def __reduce__(self):
        raise TypeError(
            f"{type(self).__module__}.{type(self).__name__} must not be pickled: persist its "
            "serialized bytes / layouts (what NxDModel.save and NxDModel.load use)"
        )
