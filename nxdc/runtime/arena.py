"""Host memory for a loaded export: one anonymous mapping on transparent huge pages.

Decode streams every weight once per step. ``safetensors.load_file`` hands back tensors
that live in a private mapping of the file: 4 KiB pages, so the stream pays a TLB miss every
4 KiB and the hardware prefetchers restart at every page. Copying the weights (and the KV
cache) into one 2 MiB-aligned anonymous mapping with ``MADV_HUGEPAGE`` made a SmolLM2 decode
step 8–14% faster at fp32 / fp16 and 5% at int8 (docs/performance.md). Where the kernel gives
no huge pages (THP ``never``, not Linux) the same memory works on small pages.
"""

from __future__ import annotations

import mmap
import re

import torch

HUGE = 2 << 20  # x86-64 transparent huge page
ALIGN = 64  # every tensor starts on a cache line (AVX-512 loads)


def _aligned(nbytes: int) -> int:
    return (nbytes + ALIGN - 1) // ALIGN * ALIGN


class HostArena:
    """A bump allocator over one anonymous mapping of ``nbytes`` (rounded up). The mapping
    lives as long as this object or any tensor carved from it."""

    def __init__(self, nbytes: int):
        self.size = max(_aligned(nbytes), ALIGN)
        try:
            self._map = mmap.mmap(-1, self.size + HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        except AttributeError:  # no POSIX mmap flags (Windows): plain memory
            self._map = None
            raw = torch.empty(self.size + HUGE, dtype=torch.uint8)
        else:
            try:  # before the first touch, so the pages are born huge
                self._map.madvise(mmap.MADV_HUGEPAGE)
            except (AttributeError, OSError, ValueError):
                pass
            raw = torch.frombuffer(self._map, dtype=torch.uint8)  # holds a reference to the mapping
        start = -raw.data_ptr() % HUGE
        self._bytes = raw[start : start + self.size]
        self._used = 0

    @staticmethod
    def bytes_for(tensors) -> int:
        """Arena bytes needed for tensors of these (shape, dtype) or tensors."""
        total = 0
        for t in tensors:
            shape, dtype = (t.shape, t.dtype) if isinstance(t, torch.Tensor) else t
            total += _aligned(torch.Size(shape).numel() * dtype.itemsize)
        return total

    def empty(self, shape, dtype: torch.dtype) -> torch.Tensor:
        n = torch.Size(shape).numel() * dtype.itemsize
        if self._used + n > self.size:
            raise RuntimeError(f"host arena of {self.size} bytes is full")
        t = self._bytes[self._used : self._used + n].view(dtype).view(shape)
        self._used += _aligned(n)
        return t

    def copy(self, src: torch.Tensor) -> torch.Tensor:
        return self.empty(src.shape, src.dtype).copy_(src)

    def zeros(self, shape, dtype: torch.dtype) -> torch.Tensor:
        return self.empty(shape, dtype).zero_()

    def huge_bytes(self) -> int:
        """Bytes of this arena the kernel backs with huge pages now (Linux; 0 elsewhere)."""
        lo = self._bytes.data_ptr()
        hi = lo + self.size
        total, inside = 0, False
        try:
            with open("/proc/self/smaps") as f:
                for line in f:
                    m = re.match(r"([0-9a-f]+)-([0-9a-f]+) ", line)
                    if m:
                        a, b = int(m[1], 16), int(m[2], 16)
                        inside = a < hi and b > lo
                    elif inside and line.startswith("AnonHugePages:"):
                        total += int(line.split()[1]) * 1024
        except OSError:
            return 0
        return min(total, self.size)
