"""nxdc: compile-and-run toolchain for decoder LLMs."""

__version__ = "0.1.0"
