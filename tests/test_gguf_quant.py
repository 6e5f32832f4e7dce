"""GGUF quantized tensors kept as stored (``--weights auto``): every kept type's blocks go into
nxdc's int8 / int4 layouts and come back as exactly what ``gguf.quants.dequantize`` gives, also
after tensor-parallel cuts and head un-permutation; SmolLM2's Q4_1 file exports with the logits of
its dequantized fp32 export."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from cpu_paths import VNNI

from nxdc.model.quant import group_values
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


def random_tensor(
    type_name: str, rows: int, k: int, seed: int, magnitude: float | None = None
) -> IndexedTensor:
    """A GGUF tensor [rows, k] of random valid blocks (random quants and scale bits, finite fp16
    fields of assorted magnitudes and signs; or of about ``magnitude``)."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    qtype = GGMLQuantizationType[type_name]
    block, size = GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(rows * k // block, size), dtype=np.uint8)
    for at in F16_FIELDS[type_name]:
        mag = magnitude if magnitude else 10.0 ** rng.integers(-4, 1, blocks.shape[0])
        vals = (rng.standard_normal(blocks.shape[0]) * mag).astype(np.float16)
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
    assert (mins is not None) == fmt.asym and (mins is None or mins.shape == scale.shape)
    # the types whose file stores d (and m) as fp16 keep them so; a K-quant's d * sc as the file
    # does: an fp16 per 256 weights (2 bytes) and an int8 per group
    if type_name in ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"):
        assert fmt.scales == "f16" and scale.dtype == torch.float16 and scale.shape == (6, 512 // fmt.group)
    else:
        assert (
            fmt.scales == "k" and scale.dtype == torch.uint8 and scale.shape == (6, 2 * 2 + 512 // fmt.group)
        )
    assert torch.equal(group_values(scale, 512), s.reshape(6, -1, fmt.group)[..., 0])
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
    assert fmt == WeightFormat("int8", 16, True, "k")
    both = torch.cat([GGUFTensor(a, None).with_params().read(), GGUFTensor(b, None).with_params().read()])
    w, s, m = both.unbind(-1)
    q, scale, mins = requantize(w, s, m, fmt, "qkv")
    from nxdc.model.quant import dequantize_int8

    assert torch.equal(dequantize_int8(q, scale, mins), torch.cat([reference(a), reference(b)]))
    assert common_format([kept_format("Q4_K"), kept_format("F16")]) is None  # F16 is not kept
    assert common_format([kept_format("Q4_0")] * 3) == WeightFormat("int4", 32, False, "f16")
    # the parts' scale storage where they share it, else fp32
    assert common_format([kept_format("Q4_0"), kept_format("Q8_0")]) == WeightFormat("int8", 32, False, "f16")
    assert common_format([kept_format("Q4_1"), kept_format("Q4_K")]) == WeightFormat("int8", 32, True, "f32")


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
    flat = dataclasses.replace(fmt, scales="f32")  # where a rank's columns split a super-block
    for role in (Q_HEADS, HEAD_COLS):
        for rank in range(2):
            w, s, m = rank_tensor(
                role, "weight", GGUFTensor(t, spec.head_dim).with_params(), spec, layout, rank
            ).unbind(-1)
            assert torch.equal(
                w, rank_tensor(role, "weight", GGUFTensor(t, spec.head_dim), spec, layout, rank)
            )
            if role == HEAD_COLS:  # 128 of a row's 256 inputs: half a super-block
                assert fmt.check_inputs(w.shape[1], "o_proj") == (
                    "o_proj has 128 inputs per row, which 256-weight super-blocks do not divide"
                )
                with pytest.raises(AssertionError, match="256-weight super-blocks"):
                    requantize(w, s, m, fmt, role)
            requantize(w, s, m, flat if role == HEAD_COLS else fmt, role)  # raises unless exact
    w, s, m = GGUFTensor(t, None).with_params().read().unbind(-1)
    with pytest.raises(AssertionError, match="change within a 32-weight group"):
        requantize(w[:, 16:240], s[:, 16:240], m[:, 16:240], fmt, "cut")


# A Q4_K_M file's layout (llama.cpp's choice of type per tensor), for a 2-layer Llama
KQUANT_LAYER = {
    "attn_q": ("Q4_K", 256, 256),
    "attn_k": ("Q4_K", 128, 256),
    "attn_v": ("Q6_K", 128, 256),
    "attn_output": ("Q4_K", 256, 256),
    "ffn_gate": ("Q4_K", 512, 256),
    "ffn_up": ("Q4_K", 512, 256),
    "ffn_down": ("Q6_K", 256, 512),
}


@pytest.fixture(scope="module")
def kquant_gguf(tmp_path_factory):
    """A 2-layer Llama GGUF (hidden 256, FFN 512, 4 / 2 heads, the embedding tied to the output)
    of random K-quant blocks laid out as in a Q4_K_M file, with the embedded SmolLM2's tokenizer
    metadata."""
    from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter

    from nxdc.weights.sources import embedded_path

    shape = {
        "llama.block_count": 2,
        "llama.embedding_length": 256,
        "llama.feed_forward_length": 512,
        "llama.attention.head_count": 4,
        "llama.attention.head_count_kv": 2,
        "llama.rope.dimension_count": 64,
        "llama.context_length": 512,
    }
    src = GGUFReader(str(embedded_path("smollm2-135m")))
    vocab = len(src.fields["tokenizer.ggml.tokens"].data)
    path = tmp_path_factory.mktemp("kquant") / "tiny-Q4_K_M.gguf"
    w = GGUFWriter(str(path), "llama")
    for f in src.fields.values():
        if not f.name.startswith("GGUF.") and f.name != "general.architecture":
            w.add_key_value(
                f.name, shape.get(f.name, f.contents()), f.types[0], f.types[1] if len(f.types) > 1 else None
            )
    tensors = {"token_embd.weight": ("Q4_K", vocab, 256), "output_norm.weight": None}
    for i in range(2):
        tensors |= {f"blk.{i}.{n}.weight": t for n, t in KQUANT_LAYER.items()}
        tensors |= {f"blk.{i}.attn_norm.weight": None, f"blk.{i}.ffn_norm.weight": None}
    for seed, (name, t) in enumerate(tensors.items()):
        if t is None:  # a norm
            w.add_tensor(name, np.ones(256, np.float32))
            continue
        r = random_tensor(t[0], t[1], t[2], seed, magnitude=2e-4)
        w.add_tensor(name, r.data, raw_dtype=GGMLQuantizationType[t[0]])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_kquant_gguf_kept_as_stored_gives_the_dequantized_logits(kquant_gguf):
    """A Q4_K_M-shaped file with ``--weights auto``: its Q4_K / Q6_K tensors (and the fused q/k/v
    that mixes them) are kept, and the model's logits equal those of its fp32 export (the file
    dequantized) within fp32 rounding, with exact products and (decode) int8 activations' own
    numerics reported; at tp 2 every rank's cut still falls on a group boundary."""
    from nxdc.accuracy import measure_formats
    from nxdc.pipeline import prepare
    from nxdc.plan import ExportOptions

    plan = prepare(str(kquant_gguf), ExportOptions(sequence_length=128, weights="auto"))[3]
    layer = {
        k.partition(".")[2].partition(".")[2]: v
        for k, v in plan.weight_map.items()
        if k.startswith("layers.0.")
    }
    assert layer == {  # two-level scales (-k), as the file stores them
        "self_attn.qkv_proj": "int8-asym-g16-k",  # Q4_K q, k with a Q6_K v
        "self_attn.o_proj": "int4-asym-g32-k",
        "mlp.gate_up_proj": "int4-asym-g32-k",
        "mlp.down_proj": "int8-g16-k",
    }
    # the embedding (tied: the lm_head) keeps the same values with fp32 scales: a lookup
    # dequantizes in PyTorch ops
    assert plan.weight_map["embed_tokens"] == plan.weight_map["lm_head"] == "int4-asym-g32"
    tp2 = prepare(str(kquant_gguf), ExportOptions(sequence_length=128, weights="auto", tp=2))[3]
    # at tp 2 o_proj's 256 inputs split into 128 a rank: half a super-block, so fp32 scales
    o_proj = {k: "int4-asym-g32" for k in plan.weight_map if k.endswith("o_proj")}
    assert tp2.weight_map == plan.weight_map | o_proj
    (r,) = measure_formats(
        str(kquant_gguf), ExportOptions(sequence_length=128, decode_matmul="int8"), ["auto"]
    )
    assert r["tokens"] > 100 and r["top1_agreement"] == 1.0 and r["max_abs_logit_error"] < 1e-3, r
    if VNNI:  # every layer on int8 activations: close, not equal
        assert 0 < r["decode"]["max_abs_logit_error"] and r["decode"]["top1_agreement"] >= 0.9, r["decode"]


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
    assert set(plan.weight_map.values()) == {"int4-asym-g32-f16", "int8-g32-f16"}  # the file's fp16 scales
    assert plan.weight_map["lm_head"] == plan.weight_map["embed_tokens"] == "int8-g32-f16"
    # the default for a GGUF file at --dtype fp32 where nxdc's kernels run; --weights fp32 dequantizes
    default = prepare("smollm2-135m", ExportOptions(sequence_length=256))[3]
    assert (default.weights, default.weight_map) == (
        (plan.weights, plan.weight_map) if kernels_apply(plan) else (None, None)
    )
    assert prepare("smollm2-135m", ExportOptions(sequence_length=256, weights="fp32"))[3].weights is None
    assert prepare("smollm2-135m", ExportOptions(sequence_length=256, dtype="bf16"))[3].weights is None
    (r,) = measure_formats("smollm2-135m", ExportOptions(sequence_length=256), ["auto"])
    assert r["top1_agreement"] == 1.0 and r["max_abs_logit_error"] < 1e-3, r
