"""Machine facts for benchmark reports: versions, ISA, threads, memory bandwidth."""

from __future__ import annotations

import os
import platform
import resource
import time

import torch

import nxdc
from nxdc.runtime.arena import HostArena


def read_bandwidth_gbs(threads: int, mib: int = 512, reps: int = 8, device: str = "cpu") -> float:
    """Best-of read-only streaming rate of a large fp32 reduction (what a matvec needs), on the
    host or, for an accelerator's exports, on that device (2 GiB there: far beyond its cache)."""
    torch.set_num_threads(threads)
    on_gpu = torch.device(device).type == "cuda"
    a = _read_buffer(device, (4 * mib if on_gpu else mib) * 2**20 // 4)
    a.sum()
    best = min(_timed(a.sum, on_gpu) for _ in range(reps))
    return a.numel() * 4 / best / 1e9


# The read samples' buffers, kept for the life of the process. `nxdc bench` samples before and
# after every run; freeing 512 MiB each time stalled one decode step of the next run by 20-30 ms
# about 1.5 s later (Zen 4 VM: a step of 13 ms took 35-47 ms, once or twice per 128-token run;
# none with the buffer kept), which is what the bench's ITL p99 of ~50 ms was.
_READ_BUFFERS: dict[tuple[str, int], torch.Tensor] = {}


def _read_buffer(device: str, n: int) -> torch.Tensor:
    key = (str(torch.device(device)), n)
    if key not in _READ_BUFFERS:
        if torch.device(device).type == "cuda":
            _READ_BUFFERS[key] = torch.ones(n, device=device)
        else:  # on huge pages, as a loaded export's weights (nxdc/runtime/arena.py)
            _READ_BUFFERS[key] = HostArena(n * 4).empty((n,), torch.float32).fill_(1.0)
    return _READ_BUFFERS[key]


def read_buffers_mib() -> float:
    """Memory the read samples hold for the life of the process (part of its peak RSS)."""
    return sum(t.numel() * t.element_size() for t in _READ_BUFFERS.values()) / 2**20


def copy_bandwidth_gbs(threads: int, mib: int = 512, reps: int = 8) -> float:
    """Best-of copy rate, counting bytes read plus bytes written (STREAM convention)."""
    torch.set_num_threads(threads)
    arena = HostArena(2 * mib * 2**20)
    a = arena.empty((mib * 2**20 // 4,), torch.float32).fill_(1.0)
    b = arena.empty(a.shape, torch.float32)
    best = min(_timed(lambda: b.copy_(a)) for _ in range(reps))
    return 2 * a.numel() * 4 / best / 1e9


def _timed(fn, sync: bool = False) -> float:
    t = time.perf_counter()
    fn()
    if sync:
        torch.cuda.synchronize()
    return time.perf_counter() - t


def peak_rss_mib() -> float:
    """Peak resident set size of this process (since ``reset_peak_rss``, where Linux allows it)."""
    try:
        for line in open("/proc/self/status"):
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def reset_peak_rss() -> None:
    """Start the peak over (Linux >= 4.0: VmHWM := VmRSS), so that it measures what comes next,
    not the bandwidth samples' buffers before it."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def machine_info(threads: int) -> dict:

    cpu = platform.processor() or platform.machine()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cores_available": len(os.sched_getaffinity(0))
        if hasattr(os, "sched_getaffinity")
        else os.cpu_count(),
        "threads": threads,
        "isa": torch.backends.cpu.get_cpu_capability(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "nxdc": nxdc.__version__,
        "read_bandwidth_gbs": round(read_bandwidth_gbs(threads), 2),
        "copy_bandwidth_gbs": round(copy_bandwidth_gbs(threads), 2),
    }
