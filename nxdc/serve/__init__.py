"""``nxdc serve``: an OpenAI-compatible server with continuous batching over an export's batch
rows. ``app.py`` (HTTP, no torch) -> ``engine_process.py`` (its own process) -> ``engine.py``
(the scheduler) -> ``nxdc.runtime.runner.Runner`` (the graphs). docs/serve.md."""
