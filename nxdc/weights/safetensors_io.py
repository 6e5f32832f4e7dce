"""safetensors files written tensor by tensor, in any order, and read tensor by tensor into
memory the caller allocates, so that neither an export nor a loaded model holds a rank's
weights twice (an 8B model's bf16 rank file is 15 GiB).

The safetensors library writes a file from a complete dict only. The format is simple (an 8-byte
little-endian header length, a JSON header naming each tensor's dtype, shape and byte range, then
the bytes), and every name, dtype and shape is known before the first weight is read (the model's
stored state on the meta device), so the header is written first, the file sized, and each
tensor's bytes land at its offset as it arrives. The result reads back with ``safetensors``.
Reading, ``safetensors.load_file`` maps the file, and every page a copy touches stays mapped
(resident, counted to the process) until the last tensor is dropped; ``read_into`` reads each
tensor's bytes straight into its destination with ``readinto``, so only the destination is
resident."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import torch

DTYPES = {
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.int32: "I32",
    torch.int64: "I64",
    torch.bool: "BOOL",
}

NAMES = {v: k for k, v in DTYPES.items()}


def read_layout(path: Path) -> tuple[dict[str, tuple[torch.dtype, tuple[int, ...], int, int]], int]:
    """A safetensors file's tensors, {name: (dtype, shape, start, end)} with byte offsets into
    the data, and where the data starts. Raises ValueError on a malformed header."""
    with open(path, "rb") as f:
        head = f.read(8)
        n = int.from_bytes(head, "little") if len(head) == 8 else -1
        if not 0 < n <= 100 * 2**20:
            raise ValueError(f"{Path(path).name}: not a safetensors file")
        try:
            header = json.loads(f.read(n))
            out = {
                name: (NAMES[v["dtype"]], tuple(v["shape"]), *v["data_offsets"])
                for name, v in header.items()
                if name != "__metadata__"
            }
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{Path(path).name}: malformed safetensors header ({e})") from None
    return out, 8 + n


def read_into(
    path: Path, alloc: Callable[[tuple[int, ...], torch.dtype], torch.Tensor], layout=None
) -> dict[str, torch.Tensor]:
    """Every tensor of the file, each read into ``alloc(shape, dtype)`` (a contiguous CPU tensor)
    in file order; ``layout``: what ``read_layout(path)`` returned, if the caller has it already.
    Raises ValueError on a malformed or truncated file."""
    layout, start = layout or read_layout(path)
    out = {}
    with open(path, "rb", buffering=0) as f:
        for name, (dtype, shape, a, b) in sorted(layout.items(), key=lambda kv: kv[1][2]):
            t = alloc(shape, dtype)
            if b - a != t.numel() * t.element_size():
                raise ValueError(
                    f"{Path(path).name}: {name} holds {b - a} bytes, its shape {shape} needs more or less"
                )
            f.seek(start + a)
            view, got = memoryview(t.reshape(-1).view(torch.uint8).numpy()), 0
            while got < b - a:
                k = f.readinto(view[got:])
                if not k:
                    raise ValueError(f"{Path(path).name}: truncated in {name}")
                got += k
            out[name] = t
    return out


class SafetensorsWriter:
    """``with SafetensorsWriter(path, layout) as w: w.write(name, tensor) ...``: ``layout`` maps
    every name to a tensor (meta is fine) of the dtype and shape that ``write`` must give it. The
    file is complete only if every name was written (checked at exit)."""

    def __init__(self, path: Path, layout: dict[str, torch.Tensor], metadata: dict[str, str] | None = None):
        self.path, self.spans, self.done = Path(path), {}, set()
        self.layout = {n: (t.dtype, tuple(t.shape)) for n, t in layout.items()}
        header: dict = {"__metadata__": metadata} if metadata else {}
        offset = 0
        # widest dtypes first, as safetensors does: every tensor starts aligned to its element size
        for name in sorted(layout, key=lambda n: (-layout[n].element_size(), n)):
            t = layout[name]
            size = t.numel() * t.element_size()
            header[name] = {
                "dtype": DTYPES[t.dtype],
                "shape": list(t.shape),
                "data_offsets": [offset, offset + size],
            }
            self.spans[name] = offset
            offset += size
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        self.start = 8 + len(raw)
        self.f = open(self.path, "wb")  # noqa: SIM115 (closed in close())
        self.f.write(len(raw).to_bytes(8, "little") + raw)
        self.f.truncate(self.start + offset)

    def write(self, name: str, t: torch.Tensor) -> None:
        want = self.layout.get(name)
        if want is None or name in self.done:
            raise ValueError(
                f"{self.path.name}: {name} is {'written twice' if want else 'not in the layout'}"
            )
        if (t.dtype, tuple(t.shape)) != want:
            raise ValueError(
                f"{self.path.name}: {name} is {t.dtype} {tuple(t.shape)}, the layout says {want}"
            )
        self.f.seek(self.start + self.spans[name])
        if t.numel():
            self.f.write(memoryview(t.detach().cpu().contiguous().view(torch.uint8).numpy()))
        self.done.add(name)

    def close(self) -> None:
        self.f.close()
        missing = sorted(set(self.layout) - self.done)
        if missing:
            raise ValueError(f"{self.path.name}: {len(missing)} tensors never written, e.g. {missing[:3]}")

    def __enter__(self) -> SafetensorsWriter:
        return self

    def __exit__(self, kind, *_) -> None:
        if kind is None:
            self.close()
        else:  # the caller's error wins; the partial file is the caller's temp path
            self.f.close()
            os.unlink(self.path)
