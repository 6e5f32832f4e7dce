"""weights/safetensors_io.py: a safetensors file written tensor by tensor reads back with safetensors."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from nxdc.weights.safetensors_io import SafetensorsWriter


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "a.weight": torch.randn(5, 7, generator=g).to(torch.bfloat16),
        "a.scale": torch.randn(5, 3, generator=g),
        "b.weight": torch.randint(-128, 127, (4, 6), generator=g, dtype=torch.int8),
        "c.weight": torch.randint(0, 255, (3, 9), generator=g, dtype=torch.uint8),
        "d.bias": torch.randn(3, generator=g).half(),
        "e.empty": torch.empty(0, 4),
    }


def test_written_in_any_order_reads_back(tmp_path):
    want = _tensors()
    layout = {n: torch.empty(t.shape, dtype=t.dtype, device="meta") for n, t in want.items()}
    with SafetensorsWriter(tmp_path / "w.safetensors", layout, metadata={"format": "pt"}) as w:
        for name in reversed(list(want)):
            w.write(name, want[name])
    got = load_file(str(tmp_path / "w.safetensors"))
    assert set(got) == set(want)
    for n, t in want.items():
        assert got[n].dtype == t.dtype and torch.equal(got[n], t), n
    with safe_open(str(tmp_path / "w.safetensors"), "pt") as f:
        assert f.metadata() == {"format": "pt"}


def test_wrong_shape_missing_or_repeated_tensors_fail_and_leave_no_file(tmp_path):
    want = _tensors()
    layout = {n: torch.empty(t.shape, dtype=t.dtype, device="meta") for n, t in want.items()}
    path = tmp_path / "w.safetensors"
    with pytest.raises(ValueError, match="the layout says"), SafetensorsWriter(path, layout) as w:
        w.write("a.weight", want["a.weight"].float())
    assert not path.exists()
    with pytest.raises(ValueError, match="written twice"), SafetensorsWriter(path, layout) as w:
        w.write("a.scale", want["a.scale"])
        w.write("a.scale", want["a.scale"])
    with pytest.raises(ValueError, match="never written"), SafetensorsWriter(path, layout) as w:
        w.write("a.scale", want["a.scale"])


def test_read_into_fills_the_callers_memory(tmp_path):
    from safetensors.torch import save_file

    from nxdc.weights.safetensors_io import read_into

    want = _tensors()
    save_file(want, str(tmp_path / "w.safetensors"))
    given = []

    def alloc(shape, dtype):
        given.append(
            torch.full(shape, 7, dtype=dtype) if dtype != torch.bool else torch.empty(shape, dtype=dtype)
        )
        return given[-1]

    got = read_into(tmp_path / "w.safetensors", alloc)
    assert set(got) == set(want) and len(given) == len(want)
    for n, t in want.items():
        assert any(got[n] is g for g in given) and torch.equal(got[n], t), n


def test_read_into_refuses_truncated_or_garbage_files(tmp_path):
    from safetensors.torch import save_file

    from nxdc.weights.safetensors_io import read_into

    path = tmp_path / "w.safetensors"
    save_file(_tensors(), str(path))
    data = path.read_bytes()
    path.write_bytes(data[:-10])
    with pytest.raises(ValueError, match="truncated"):
        read_into(path, lambda shape, dtype: torch.empty(shape, dtype=dtype))
    path.write_bytes(b"\xff" * 64)
    with pytest.raises(ValueError, match="not a safetensors file"):
        read_into(path, lambda shape, dtype: torch.empty(shape, dtype=dtype))
    path.write_bytes((20).to_bytes(8, "little") + b"{not json}          ")
    with pytest.raises(ValueError, match="malformed"):
        read_into(path, lambda shape, dtype: torch.empty(shape, dtype=dtype))
