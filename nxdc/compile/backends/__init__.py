"""Compile backends: what turns one bucket of the decoder into files, and those files back into a
callable graph.

A backend builds a bucket from the model (it traces as it needs to), writes one or more files
per bucket, names the cache namespace and key parts that decide its code, and loads the files
with the rank's weights and KV caches (``GraphState``). ``inductor`` (torch.export +
AOTInductor, CPU or CUDA) is the default; ``xla`` (torch.export -> StableHLO on torch-xla's CPU
client) runs in its own environment (``make test-xla``); ``neuron`` (NxD trace / compile ->
NEFF, run by one NxDModel for every rank) needs the AWS Neuron SDK. docs/backends.md and
docs/neuron.md say what each has been run on.

A backend is one file here (its ``create``, ``validate`` and ``doctor`` functions and its
``Backend``; ``base.py``) plus its entry in ``registry.py`` (its name, devices, KV-update modes
and the facts the rest of nxdc asks about), which planning, the CLI's help, ``nxdc doctor`` and
the runtime read. This package's ``__init__`` imports nothing, so the registry (and the CLI that
reads it) loads without torch."""
