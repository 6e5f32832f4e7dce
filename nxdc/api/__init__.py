"""nxdc's public Python API, one module per entry point (``export.py``: ``nxdc.export``;
``model.py``: ``nxdc.load``, ``Model``, ``Completion``; ``causal_lm.py``:
``NxdcModelForCausalLM``). Import it as ``nxdc.export``, ``nxdc.load``, ...: ``nxdc/__init__.py``
loads these modules on first use."""
