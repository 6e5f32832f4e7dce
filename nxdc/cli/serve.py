"""`nxdc serve EXPORT`: an OpenAI-compatible HTTP server with continuous batching."""

from __future__ import annotations

import signal
import socket
from pathlib import Path

import typer

from nxdc.cli.common import QUIET, VERBOSE, cli_errors
from nxdc.errors import UserInputError

# the longer option declarations of `serve`
API_KEY = typer.Option(
    None,
    "--api-key",
    envvar="NXDC_API_KEY",
    help="Require 'Authorization: Bearer KEY' (not /health, /metrics).",
)
SERVED_MODEL_NAME = typer.Option(
    None,
    "--served-model-name",
    help="The model id clients name. \\[default: the export directory's name]",
)
PREFILL_CHUNK = typer.Option(
    None,
    "--prefill-chunk",
    help="Most prompt tokens per engine step. While streams decode, a step takes the largest chunk "
    "graph that keeps it within 2 decode steps (measured). \\[default: the largest chunk graph <= 128]",
)
STEP_BUDGET = typer.Option(
    None,
    "--step-budget",
    help="While streams decode, a step (decode + prefill chunk) may take up to this many decode "
    "steps per request waiting for its first token; higher: faster prefill (TTFT, throughput), "
    "lower: steadier streams; 0: no budget (--prefill-chunk every step). \\[default: 2]",
)


@cli_errors
def serve(
    export_dir: Path = typer.Argument(..., help="Export directory with serving graphs (--chunk-buckets)."),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to bind (0.0.0.0: every interface)."),
    port: int = typer.Option(8000, "--port"),
    api_key: str = API_KEY,
    api_key_file: Path = typer.Option(None, "--api-key-file", help="Read the API key from this file."),
    served_model_name: str = SERVED_MODEL_NAME,
    max_queue: int = typer.Option(64, "--max-queue", help="Running + queued requests before answering 429."),
    queue_timeout: float = typer.Option(
        None, "--queue-timeout", help="Seconds a request may wait for a batch row (then 503)."
    ),
    request_timeout: float = typer.Option(
        None, "--request-timeout", help="Seconds a request may take in all."
    ),
    prefill_chunk: int = PREFILL_CHUNK,
    step_budget: float = STEP_BUDGET,
    threads: int = typer.Option(
        None, "--threads", help="CPU threads of the engine. \\[default: cores available]"
    ),
    max_body_bytes: int = typer.Option(
        1 << 20, "--max-body-bytes", help="Largest request body accepted (larger: 413)."
    ),
    quiet: bool = QUIET,
    verbose: bool = VERBOSE,
) -> None:
    """Serve an export over HTTP (OpenAI API: /v1/completions, /v1/chat/completions), batching requests
    as they arrive into the export's batch rows."""
    from nxdc.serve.app import ServeConfig

    api_key = _api_key(api_key, api_key_file)
    _check_limits(
        max_queue, threads, prefill_chunk, max_body_bytes, step_budget, queue_timeout, request_timeout
    )
    if not 0 <= port < 65536:
        raise UserInputError(f"--port must be 0..65535 (got {port}; 0: any free port)")
    sock = _listen(host, port)
    cfg = ServeConfig(
        export_dir=export_dir,
        host=host,
        port=sock.getsockname()[1],
        name=served_model_name,
        api_key=api_key,
        max_queue=max_queue,
        queue_timeout=queue_timeout,
        request_timeout=request_timeout,
        prefill_chunk=prefill_chunk,
        step_budget=step_budget,
        threads=threads,
        max_body_bytes=max_body_bytes,
        quiet=quiet,
    )
    _run(cfg, sock)


def _api_key(api_key: str | None, api_key_file: Path | None) -> str | None:
    if api_key and api_key_file:
        raise UserInputError("give --api-key or --api-key-file, not both")
    if api_key_file is None:
        return api_key
    try:
        api_key = api_key_file.read_text().strip()
    except OSError as e:
        raise UserInputError(f"--api-key-file {api_key_file}: {e.strerror}") from None
    if not api_key:
        raise UserInputError(f"--api-key-file {api_key_file} is empty")
    return api_key


def _check_limits(
    max_queue, threads, prefill_chunk, max_body_bytes, step_budget, queue_timeout, request_timeout
):
    for name, value in (
        ("max-queue", max_queue),
        ("threads", threads),
        ("prefill-chunk", prefill_chunk),
        ("max-body-bytes", max_body_bytes),
    ):
        if value is not None and value < 1:
            raise UserInputError(f"--{name} must be a positive integer (got {value})")
    if step_budget is not None and not (step_budget == 0 or 1 <= step_budget < float("inf")):
        raise UserInputError(f"--step-budget must be 0 (off) or at least 1 decode step (got {step_budget})")
    for name, value in (("queue-timeout", queue_timeout), ("request-timeout", request_timeout)):
        if value is not None and value <= 0:
            raise UserInputError(f"--{name} must be a positive number of seconds (got {value})")


def _run(cfg, sock: socket.socket) -> None:
    """Serve until SIGTERM / Ctrl-C (or a fatal engine error, which becomes the exit status)."""
    import uvicorn

    from nxdc.serve.app import Server

    server = Server(cfg)  # checks the export
    uv = _uvicorn_server(
        uvicorn.Config(server.app, log_level="warning", access_log=False, lifespan="on"),
        on_drain=lambda: setattr(server, "state", "draining"),
    )
    server.on_fatal = lambda msg: setattr(uv, "should_exit", True)
    uv.run(sockets=[sock])
    if server.fatal is not None:
        from nxdc.errors import NxdcError

        err = NxdcError(server.fatal.message)
        err.exit_code = server.fatal.exit_code
        raise err
    if not uv.started:
        raise typer.Exit(1)


def _listen(host: str, port: int) -> socket.socket:
    """Bind here, so that a taken port is a one-line error and --port 0 picks a free one."""
    try:
        info = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(info[0], socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(info[4])
    except OSError as e:
        raise UserInputError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    return sock


def _uvicorn_server(config, on_drain):
    """uvicorn's Server with nxdc's shutdown: SIGTERM (or Ctrl-C) stops accepting connections,
    marks the server draining (a new request on an open connection gets 503), lets every running
    request finish, then exits (0 after SIGTERM)."""
    import uvicorn

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):
            on_drain()
            super().handle_exit(sig, frame)
            if sig == signal.SIGTERM and sig in self._captured_signals:
                self._captured_signals.remove(sig)  # a drained SIGTERM is a clean exit

    return Server(config)
