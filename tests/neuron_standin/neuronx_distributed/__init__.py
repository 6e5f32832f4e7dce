"""CONTRACT STAND-IN for neuronx-distributed (tests/neuron_standin/README.md). Like the real
package's ``__init__.py``, it defines no ``__version__``."""

from .trace.nxd_model import NxDModel
from .trace.parallel_context import NxDParallelState

__all__ = ["NxDModel", "NxDParallelState"]
