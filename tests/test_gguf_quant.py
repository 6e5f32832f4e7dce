"""GGUF quantized tensors kept as stored (``--weights auto``): every kept type's blocks go into
nxdc's int8 / int4 layouts and come back as exactly what ``gguf.quants.dequantize`` gives, also
after tensor-parallel cuts and head un-permutation; SmolLM2's Q4_1 file exports with the logits of
its dequantized fp32 export."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from nxdc.model.sharding import HEAD_COLS, Q_HEADS, shard_layout
from nxdc.model.weight_format import WeightFormat
from nxdc.weights.gguf_index import IndexedTensor
from nxdc.weights.gguf_quant import KEPT, common_format, kept_format, requantize
from nxdc.weights.gguf_source import GGUFTensor
from nxdc.weights.shard import rank_tensor

# byte ranges of each type's fp16 fields (random bytes there could be inf / nan)
F16_FIELDS = {
    "Q8_0": [0],
    "Q4_0": [0],
    "Q4_1": [0, 2],
    "Q5_0": [0],
    "Q5_1": [0, 2],
    "Q4_K": [0, 2],
    "Q5_K": [0, 2],
    "Q6_K": [208],
}


def random_tensor(type_name: str, rows: int, k: int, seed: int) -> IndexedTensor:
    """A GGUF tensor [rows, k] of random valid blocks (random quants and scale bits, finite fp16
    fields of assorted magnitudes and signs)."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    qtype = GGMLQuantizationType[type_name]
    block, size = GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(rows * k // block, size), dtype=np.uint8)
    for at in F16_FIELDS[type_name]:
        vals = (rng.standard_normal(blocks.shape[0]) * 10.0 ** rng.integers(-4, 1, blocks.shape[0])).astype(
            np.float16
        )
        vals[::7] = 0  # some all-zero scales
        blocks[:, at : at + 2] = vals.view(np.uint8).reshape(-1, 2)
    data = blocks.reshape(rows, k // block * size)
    return IndexedTensor(f"blk.0.{type_name}", qtype, np.array([k, rows], dtype=np.uint64), data)


def reference(t: IndexedTensor) -> torch.Tensor:
    from gguf.quants import dequantize

    return torch.from_numpy(np.ascontiguousarray(dequantize(t.data, t.tensor_type)).copy())


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory):
    """A GGUF file holding one [6, 512] tensor of random valid blocks of every kept type, written
    with gguf's own writer and read back through nxdc's index."""
    from gguf import GGUFWriter

    from nxdc.weights.gguf_index import read_index

    path = tmp_path_factory.mktemp("gguf") / "blocks.gguf"
    w = GGUFWriter(str(path), "llama")
    for i, type_name in enumerate(sorted(KEPT)):
        t = random_tensor(type_name, rows=6, k=512, seed=i)
        w.add_tensor(t.name, t.data, raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return {t.tensor_type.name: t for t in read_index(path)}


@pytest.mark.parametrize("type_name", sorted(KEPT))
def test_every_kept_type_is_stored_bit_exact(type_name, gguf_file, monkeypatch):
    from nxdc.weights import gguf_source

    t = gguf_file[type_name]
    assert tuple(int(d) for d in t.shape) == (512, 6)
    ref = reference(t)
    got = GGUFTensor(t, None).with_params().read()
    assert got.shape == (6, 512, 3)
    monkeypatch.setattr(gguf_source, "CHUNK_WEIGHTS", 4 * 512)  # read 4 rows at a time: 2 chunks
    assert torch.equal(GGUFTensor(t, None).with_params().read(), got)
    assert torch.equal(GGUFTensor(t, None).with_params().read(slice(1, 6)), got[1:])
    w, s, m = got.unbind(-1)
    assert torch.equal(w, ref)
    fmt = kept_format(type_name)
    q, scale, mins = requantize(w, s, m, fmt, type_name)
    assert q.dtype == (torch.uint8 if fmt.kind == "int4" else torch.int8)
    assert scale.shape == (6, 512 // fmt.group) and (mins is not None) == fmt.asym
    from nxdc.model.quant import dequantize_int4, dequantize_int8

    back = dequantize_int4(q, scale, mins) if fmt.kind == "int4" else dequantize_int8(q, scale, mins)
    assert torch.equal(back, ref)  # bit for bit (-0.0 == 0.0)


def test_requantize_row_chunks_equal_one_pass(monkeypatch):
    """``requantize`` works a few rows at a time (bounded memory): the same tensors as in one
    pass, and a value it cannot keep is found in whichever chunk it sits."""
    from nxdc.weights import gguf_quant

    t = random_tensor("Q4_K", rows=10, k=256, seed=7)
    w, s, m = GGUFTensor(t, None).with_params().read().unbind(-1)
    fmt = kept_format("Q4_K")
    whole = requantize(w, s, m, fmt, "w")
    monkeypatch.setattr(gguf_quant, "CHUNK_WEIGHTS", 3 * 256)  # 3 rows a chunk: 4 chunks
    chunked = requantize(w, s, m, fmt, "w")
    assert all(torch.equal(a, b) for a, b in zip(whole, chunked, strict=True))
    w2 = w.clone()
    w2[8, 5] += s[8, 5] / 3  # off the grid, in the last chunk
    with pytest.raises(AssertionError, match="w: 1 values of the GGUF tensor are not kept exactly"):
        requantize(w2, s, m, fmt, "w")


def test_kernels_read_kept_blocks_as_the_reference_matmul():
    """The kernels on kept blocks compute x @ gguf-dequantized^T (the same sums as for any int8 /
    int4 weight: within fp32 rounding of an fp64 reference)."""
    from nxdc.kernels import ensure_loaded

    if not ensure_loaded():
        pytest.skip("nxdc CPU kernels unavailable on this machine")
    for type_name in ("Q4_K", "Q6_K", "Q4_1", "Q5_K"):
        t = random_tensor(type_name, rows=40, k=256, seed=3)
        w, s, m = GGUFTensor(t, None).with_params().read().unbind(-1)
        fmt = kept_format(type_name)
        q, scale, mins = requantize(w, s, m, fmt, type_name)
        op = torch.ops.nxdc.linear_i4 if fmt.kind == "int4" else torch.ops.nxdc.linear_i8
        x = torch.randn(3, 256)
        got = op(x, q, scale, mins) if mins is not None else op(x, q, scale)
        ref = x.double() @ w.double().t()
        bound = 1e-6 * 16 * (x.double().abs() @ w.double().abs().t()) + 1e-30
        assert bool(((got.double() - ref).abs() <= bound).all()), type_name


def test_mixed_parts_share_an_int8_format_that_holds_both():
    """A fused weight of a Q4_K and a Q6_K part (q/k/v in a Q4_K_M file) is int8 with a min and
    the smaller group: both parts' values exactly."""
    a, b = random_tensor("Q4_K", 4, 256, 1), random_tensor("Q6_K", 2, 256, 2)
    fmt = common_format([kept_format("Q4_K"), kept_format("Q6_K")])
    assert fmt == WeightFormat("int8", 16, True)
    both = torch.cat([GGUFTensor(a, None).with_params().read(), GGUFTensor(b, None).with_params().read()])
    w, s, m = both.unbind(-1)
    q, scale, mins = requantize(w, s, m, fmt, "qkv")
    from nxdc.model.quant import dequantize_int8

    assert torch.equal(dequantize_int8(q, scale, mins), torch.cat([reference(a), reference(b)]))
    assert common_format([kept_format("Q4_K"), kept_format("F16")]) is None  # F16 is not kept
    assert common_format([kept_format("Q4_0")] * 3) == WeightFormat("int4", 32, False)


def test_scales_follow_tensor_parallel_cuts_and_head_permutation():
    """Rows cut by heads (after un-permuting q rows) and columns cut by heads carry each value's
    own scale and min: every rank's shard requantizes exactly; a cut inside a group is refused."""
    from tiny import tiny_llama_config

    from nxdc.archs import spec_from_config

    spec = spec_from_config(
        tiny_llama_config(hidden_size=256, num_attention_heads=4, num_key_value_heads=2).to_dict()
    )
    layout = shard_layout(spec, 2)
    t = random_tensor("Q4_K", rows=256, k=256, seed=5)
    ref = GGUFTensor(t, spec.head_dim).read()  # un-permuted values
    assert torch.equal(GGUFTensor(t, spec.head_dim).with_params().read()[..., 0], ref)
    fmt = kept_format("Q4_K")
    for role in (Q_HEADS, HEAD_COLS):
        for rank in range(2):
            w, s, m = rank_tensor(
                role, "weight", GGUFTensor(t, spec.head_dim).with_params(), spec, layout, rank
            ).unbind(-1)
            assert torch.equal(
                w, rank_tensor(role, "weight", GGUFTensor(t, spec.head_dim), spec, layout, rank)
            )
            requantize(w, s, m, fmt, role)  # raises unless exact
    w, s, m = GGUFTensor(t, None).with_params().read().unbind(-1)
    with pytest.raises(AssertionError, match="change within a 32-weight group"):
        requantize(w[:, 16:240], s[:, 16:240], m[:, 16:240], fmt, "cut")


@pytest.mark.slow
def test_smollm2_gguf_kept_as_stored_gives_the_dequantized_logits():
    """The embedded SmolLM2 (Q4_1 layers, a Q8_0 embedding) with ``--weights auto``: int4 / int8
    tensors holding the file's bits, and teacher-forced logits equal to the fp32 export's (the
    file dequantized) within fp32 rounding of the kernels' sums."""
    from nxdc.accuracy import measure_formats
    from nxdc.compile.trace import kernels_apply
    from nxdc.pipeline import prepare
    from nxdc.plan import ExportOptions

    _, _, _, plan = prepare("smollm2-135m", ExportOptions(sequence_length=256, weights="auto"))
    assert plan.weights == "gguf"
    assert set(plan.weight_map.values()) == {"int4-asym-g32", "int8-g32"}
    assert plan.weight_map["lm_head"] == plan.weight_map["embed_tokens"] == "int8-g32"
    # the default for a GGUF file at --dtype fp32 where nxdc's kernels run; --weights fp32 dequantizes
    default = prepare("smollm2-135m", ExportOptions(sequence_length=256))[3]
    assert (default.weights, default.weight_map) == (
        (plan.weights, plan.weight_map) if kernels_apply(plan) else (None, None)
    )
    assert prepare("smollm2-135m", ExportOptions(sequence_length=256, weights="fp32"))[3].weights is None
    assert prepare("smollm2-135m", ExportOptions(sequence_length=256, dtype="bf16"))[3].weights is None
    (r,) = measure_formats("smollm2-135m", ExportOptions(sequence_length=256), ["auto"])
    assert r["top1_agreement"] == 1.0 and r["max_abs_logit_error"] < 1e-3, r
