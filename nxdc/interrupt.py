"""Ctrl-C and ``kill`` (SIGTERM) that cannot get lost.

Python turns SIGINT into a KeyboardInterrupt raised wherever the main thread is at the next
bytecode or signal check. During a compiled graph call that can be inside library code that
swallows it (seen once in a tensor-parallel ``generate --stream``: Ctrl-C, then all 100 tokens and
exit 0). The handler here also records the signal, and long loops call ``check()`` between steps,
so a swallowed interrupt still stops the run at the next step."""

from __future__ import annotations

import signal

_seen = False


def _handler(signum, frame):
    global _seen
    _seen = True
    raise KeyboardInterrupt


def install() -> None:
    """Handle SIGTERM, and SIGINT unless it is ignored (a parent's ``nohup`` / background job)."""
    signal.signal(signal.SIGTERM, _handler)  # `kill` unwinds like Ctrl-C: temp dirs are removed
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, _handler)


def check() -> None:
    """Raise KeyboardInterrupt if a signal arrived, even one whose exception was swallowed."""
    if _seen:
        raise KeyboardInterrupt
