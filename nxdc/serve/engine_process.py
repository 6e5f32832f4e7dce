"""The engine's own process, and the HTTP process's handle on it.

A compiled graph holds the GIL for its whole call (tens to hundreds of milliseconds), so the
engine cannot be a thread of the HTTP server: ``/health`` would stall behind every prefill.
``EngineClient`` starts ``python -m nxdc.serve.engine_process EXPORT --fd N`` with one end of a
socket pair; messages (``protocol.py``) are pickled over it with ``multiprocessing``'s framing.
The child loads the export (``open_runner``: tp 1, or the tensor-parallel group whose workers
it starts), then loops: take every message waiting (block when idle), run one engine step,
send its events. It dies with its parent and ignores Ctrl-C / SIGTERM (the parent drains, then
says ``Shutdown``)."""

from __future__ import annotations

import argparse
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
from multiprocessing.connection import Connection
from pathlib import Path

from nxdc.serve.protocol import Abort, Fatal, Ready, Shutdown, Submit


class EngineClient:
    """Parent side: start the engine process, send it messages (from any thread; a sender
    thread keeps a full socket from blocking the event loop), and hand each message it sends
    to ``on_message`` on the asyncio loop."""

    def __init__(self, export_dir: Path, options: dict, on_message):
        """``options``: the engine's command-line options by name (``threads``, ``prefill-chunk``,
        ``step-budget``); None: the engine's default."""
        self.export_dir, self.options = export_dir, options
        self.on_message = on_message
        self.proc: subprocess.Popen | None = None
        self.conn: Connection | None = None
        self._out: queue.SimpleQueue = queue.SimpleQueue()
        self._closed = False

    def start(self, loop) -> None:
        ours, theirs = socket.socketpair()
        args = [
            sys.executable,
            "-m",
            "nxdc.serve.engine_process",
            str(self.export_dir),
            "--fd",
            str(theirs.fileno()),
        ]
        for name, value in self.options.items():
            if value is not None:
                args += [f"--{name}", str(value)]
        self.proc = subprocess.Popen(args, pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL)
        theirs.close()
        self.conn = Connection(ours.detach())
        loop.add_reader(self.conn.fileno(), self._readable, loop)
        threading.Thread(target=self._send_loop, name="nxdc-engine-send", daemon=True).start()

    def send(self, msg) -> None:
        self._out.put(msg)

    def _send_loop(self) -> None:
        while True:
            msg = self._out.get()
            if msg is None:
                return
            try:
                self.conn.send(msg)
            except OSError:
                return

    def _readable(self, loop) -> None:
        try:
            while self.conn.poll():
                self.on_message(self.conn.recv())
        except (EOFError, OSError):
            loop.remove_reader(self.conn.fileno())
            if not self._closed:
                code = self.proc.wait()
                self.on_message(Fatal(f"the engine process exited unexpectedly (code {code})"))

    def close(self, timeout: float = 10.0) -> None:
        """Tell the engine to stop and wait for it (then kill it)."""
        if self._closed or self.proc is None:
            return
        self._closed = True
        self._out.put(Shutdown())
        self._out.put(None)
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _serve_loop(conn: Connection, engine) -> None:
    while True:
        block = not engine.has_work
        while conn.poll(None if block else 0):
            msg = conn.recv()
            block = False
            if isinstance(msg, Submit):
                engine.submit(msg)
            elif isinstance(msg, Abort):
                engine.abort(msg.id)
            elif isinstance(msg, Shutdown):
                return
        if engine.has_work:
            conn.send(engine.step())


def _die_with_parent() -> None:
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def main(argv: list[str] | None = None) -> int:
    import warnings

    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    ap = argparse.ArgumentParser(prog="nxdc-engine")
    ap.add_argument("export_dir")
    ap.add_argument("--fd", type=int, required=True)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--prefill-chunk", type=int, default=None)
    ap.add_argument("--step-budget", type=float, default=None)
    a = ap.parse_args(argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the HTTP process drains, then stops us
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _die_with_parent()
    conn = Connection(a.fd)
    if os.getppid() == 1:
        return 1
    from nxdc.errors import NxdcError

    runner = None
    try:
        from nxdc.runtime.workers import open_runner
        from nxdc.serve.engine import Engine
        from nxdc.serve.text import TextTokenizer

        runner = open_runner(a.export_dir, threads=a.threads)
        engine = Engine(runner, TextTokenizer(a.export_dir), a.prefill_chunk, a.step_budget)
        engine.warm_up()
        conn.send(
            Ready(
                {
                    "batch_size": runner.batch_size,
                    "max_seq": runner.max_seq,
                    "prefill_chunk": engine.chunk,
                    "prefill_chunk_beside_decoding": engine.budget.limit(decoding=True),
                    "vocab_size": runner.vocab_size,
                    "threads": runner.threads,
                    "tp": runner.plan.tp,
                }
            )
        )
        _serve_loop(conn, engine)
    except (EOFError, BrokenPipeError):  # the HTTP process is gone
        return 1
    except NxdcError as e:
        conn.send(Fatal(str(e), e.exit_code))
        return 1
    except Exception as e:
        conn.send(Fatal(f"internal error in the engine: {type(e).__name__}: {e}"))
        return 1
    finally:
        if runner is not None:
            runner.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
