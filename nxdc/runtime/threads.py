"""Thread settings for the CPU hot path.

Decode on a small CPU is very sensitive to oversubscription; the default is one thread per
core this process may run on (``os.sched_getaffinity``), overridable with ``--threads`` or
``NXDC_THREADS``."""

from __future__ import annotations

import os

from nxdc.errors import UserInputError


def default_threads() -> int:
    env = os.environ.get("NXDC_THREADS")
    if env:
        return parse_threads(env)
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


def parse_threads(value) -> int:
    try:
        n = int(value)
    except (TypeError, ValueError):
        n = 0
    if n < 1:
        raise UserInputError(f"--threads must be a positive integer (got {value!r})")
    return n


def apply_threads(n: int | None) -> int:
    import torch

    n = parse_threads(n) if n is not None else default_threads()
    torch.set_num_threads(n)
    return n
