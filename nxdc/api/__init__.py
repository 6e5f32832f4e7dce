"""nxdc's public Python API, one module per entry point (``export.py``: ``nxdc.export``).
Import it as ``nxdc.export``, ``nxdc.ExportResult``, ...: ``nxdc/__init__.py`` loads these
modules on first use."""
