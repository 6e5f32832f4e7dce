"""Shared decoder pieces: RMSNorm, rotary embeddings (incl. Llama-3 scaling), SwiGLU MLP."""

from __future__ import annotations

import contextlib
import contextvars
import math

import torch
import torch.nn.functional as F
from torch import nn

from nxdc.model.quant import dequantize_int4, dequantize_int8
from nxdc.model.sharding import MLP_COLS, MLP_ROWS, REPLICATED, Part
from nxdc.model.weight_format import SUPER, WeightFormat, parse
from nxdc.spec import ModelSpec, RopeSpec


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype, device=None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Same op order as transformers: normalise in fp32, cast back, then scale.
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(dtype)


# Reduced-precision weight storage (``--weights``, docs/weights.md, ``model/weight_format.py``):
# torch dtype and nxdc kernel op of each kind (int4: two weights a uint8).
STORED = {"fp16": torch.float16, "bf16": torch.bfloat16, "int8": torch.int8, "int4": torch.uint8}
LOWP_OPS = {"fp16": "linear_f16", "bf16": "linear_bf16", "int8": "linear_i8", "int4": "linear_i4"}
# The kernels' op for a weight kept in the compute dtype (``--dtype``, no ``--weights``).
DTYPE_OPS = {torch.float32: "linear_f32", torch.float16: "linear_f16", torch.bfloat16: "linear_bf16"}
# Activations the kernels take: fp32 as they are; fp16 / bf16 (``--dtype``) converted to fp32 on
# the way in and rounded back on the way out, as transformers' fp32-accumulating matmul rounds.
KERNEL_DTYPES = frozenset(DTYPE_OPS)
# How the kernel Linears of the graph being traced multiply: "tiles" / "tiles-int8" (prefill
# graphs, ``prefill_matmuls``), "int8" (decode / verify graphs, ``decode_matmuls``) or exactly (None).
_MATMULS = contextvars.ContextVar("nxdc_matmuls", default=None)
_TILE_MODES = ("tiles", "tiles-int8")  # the --prefill-matmul values that put layers on tiles


@contextlib.contextmanager
def _matmuls(mode: str | None):
    token = _MATMULS.set(mode)
    try:
        yield
    finally:
        _MATMULS.reset(token)


def prefill_matmuls(mode: str = "tiles"):
    """With ``mode`` "tiles" or "tiles-int8" (the plan's ``--prefill-matmul``), the kernel
    Linears that mode puts on bf16 tiles (``Linear._tiled``) call the prefill ops within it (a
    whole prompt at once: compute-bound; kernels/prefill.cpp); "exact": none. The prefill graphs
    trace their forward inside it."""
    return _matmuls(mode if mode in _TILE_MODES else None)


def decode_matmuls(int8: bool = True):
    """With ``int8``, kernel Linears of every integer format (``Linear._integer``) call the
    integer ops within it: activations quantized to int8, 32 per scale, VNNI dot products
    (kernels/decode_q8.cpp). The decode and verify graphs trace their
    forward inside it (the plan's ``--decode-matmul``); both ops keep every row's bits whatever M,
    so a verify row equals a decode row."""
    return _matmuls("int8" if int8 else None)


def quant_params(module: nn.Module) -> tuple[torch.Tensor, ...]:
    """A quantized weight's scale (and min, for asymmetric formats), as the kernels take them."""
    mins = getattr(module, "min", None)
    return (module.scale,) if mins is None else (module.scale, mins)


def dequantized(q: torch.Tensor, fmt: WeightFormat, scale: torch.Tensor, mins, dtype) -> torch.Tensor:
    """Stored rows ``q [..., K or K / 2]`` (with their scales / mins ``[..., groups]`` or ``[...]``)
    as ``dtype`` values: the reference dequantisation (``model/quant.py``) in traceable ops."""
    lead = q.shape[:-1]
    q2, s2 = q.reshape(-1, q.shape[-1]), scale.reshape(-1, *scale.shape[len(lead) :])
    m2 = None if mins is None else mins.reshape(s2.shape)
    w = dequantize_int4(q2, s2, m2) if fmt.kind == "int4" else dequantize_int8(q2, s2, m2)
    return w.reshape(*lead, w.shape[-1]).to(dtype)


class Linear(nn.Module):
    """``nn.Linear``'s parameters (``weight [out, in]``, optional ``bias``) with a choice of
    kernel: when ``kernels`` is set (nxdc's CPU kernels are in use, decided at export), every call
    (decode and prefill) runs the kernel of the weight's format (``kernels/linear.cpp``), which
    streams the weight once however many rows there are: ``nxdc::linear_f32`` / ``_f16`` /
    ``_bf16`` for a weight in the compute dtype, the format's op for a stored one. fp16 / bf16
    activations (``--dtype``) go in as fp32 and come out rounded to their dtype.

    ``store_as(name)`` keeps the weight in that format (``model/weight_format.py``: fp16, bf16, or
    int8 / int4 with a ``scale`` per row or group and, asymmetric, a ``min`` per group: fp32,
    fp16 or two-level, ``model/quant.py: group_values``);
    activations, bias and accumulation stay in the compute dtype. Without the kernels (CUDA, CPUs
    without AVX2) a stored weight is converted per call and PyTorch's matmul runs."""

    stored: str | None = None  # the format's kind (fp16 | bf16 | int8 | int4); None: compute dtype
    fmt: WeightFormat | None = None

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        dtype,
        device=None,
        shard: str = REPLICATED,
        parts: tuple[Part, ...] = (),
        kernels: bool = False,
    ):
        """``shard``: how the weight splits over ranks (``model/sharding.py``); ``parts``: the
        checkpoint tensors a combined weight is made of, in row order, each with its own role;
        ``kernels``: run nxdc's CPU kernels (decided at export)."""
        super().__init__()
        self.shard, self.parts, self.kernels = shard, parts, kernels
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype, device=device))
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device)) if bias else None

    def store_as(self, name: str) -> None:
        f = parse(name)
        self.fmt, self.stored = f, f.kind
        w = self.weight
        n, k = w.shape
        shape = (n, k // 2) if f.kind == "int4" else (n, k)
        self.weight = nn.Parameter(
            torch.empty(shape, dtype=STORED[f.kind], device=w.device), requires_grad=False
        )
        if f.quantized:
            if f.scales == "k":  # two-level: per row an fp16 a super-block, an int8 a group (bytes)
                scales, sdtype = (n, 2 * (k // SUPER) + k // f.group), torch.uint8
            else:
                scales = (n,) if f.group is None else (n, k // f.group)
                sdtype = torch.float16 if f.scales == "f16" else torch.float32
            grad = sdtype.is_floating_point
            self.scale = nn.Parameter(torch.empty(scales, dtype=sdtype, device=w.device), requires_grad=grad)
            if f.asym:
                self.min = nn.Parameter(
                    torch.empty(scales, dtype=sdtype, device=w.device), requires_grad=grad
                )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        k = x.shape[-1]
        x2 = x.reshape(x.numel() // k, k)
        if self.kernels and x.dtype in KERNEL_DTYPES:
            if self._tiled(x.dtype):
                op = "prefill_linear"
            elif self._integer():
                op = "linear_q8"
            else:
                op = LOWP_OPS[self.stored] if self.stored is not None else DTYPE_OPS[self.weight.dtype]
            y = getattr(torch.ops.nxdc, op)(x2.float(), self.weight, *self._quant()).to(x.dtype)
        elif self.stored is not None:
            y = F.linear(x2, self._dequantized(x.dtype))
        else:
            return F.linear(x, self.weight, self.bias)
        y = y.view(*x.shape[:-1], self.weight.shape[0])
        return y + self.bias if self.bias is not None else y

    def swiglu(self, x: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` for a weight that stacks ``[gate; up]`` (an MLP's gate_up_proj).
        With the kernels (no bias) one ``nxdc::swiglu`` call does both matvecs and the product,
        each thread on its own columns (``kernels/linear.cpp``); otherwise this Linear, then
        PyTorch's SiLU on the halves."""
        if self.kernels and self.bias is None and x.dtype in KERNEL_DTYPES:
            k = x.shape[-1]
            op = "prefill_swiglu" if self._tiled(x.dtype) else "swiglu_q8" if self._integer() else "swiglu"
            y = getattr(torch.ops.nxdc, op)(x.reshape(-1, k).float(), self.weight, *self._quant()).to(x.dtype)
            return y.view(*x.shape[:-1], y.shape[-1])
        gate, up = self(x).chunk(2, dim=-1)
        return F.silu(gate) * up

    def _tiled(self, dtype: torch.dtype) -> bool:
        """Whether this call, in a prefill graph, takes the bf16 tiles (weights rounded to bf16,
        8 significant bits; activations too, or as two bf16 parts): with "tiles", the formats
        whose numerics that keeps: int4 (16 levels), int8 with a min per group (only a GGUF
        K-quant's 5-6-bit tensors load so: Q5_K, Q6_K), ``--dtype bf16`` (bf16 already) and
        ``--weights bf16`` (exact in bf16; its fp32 activations go in as two bf16 parts, so each
        product is within 2^-17 of the exact one); with "tiles-int8" int8 with one scale a group
        or row as well (``--weights int8``, a kept Q8_0: its weights' rounding moves greedy
        text, SmolLM2 kept fp32's 32 tokens on 13 of 20 chat prompts against 15 exact). fp16
        weights keep exact fp32 products (bf16 does not hold them)."""
        mode = _MATMULS.get()
        if mode not in _TILE_MODES:
            return False
        f = self.fmt
        if f is None:
            return self.weight.dtype == dtype == torch.bfloat16
        return f.kind in ("int4", "bf16") or (f.kind == "int8" and (f.asym or mode == "tiles-int8"))

    def _integer(self) -> bool:
        """Whether this call, in a decode / verify graph, multiplies int8-quantized activations
        (``decode_matmuls``): every integer format (the op itself keeps the exact products for
        layouts it has no lanes for: per-row int8, int4 groups of 96...)."""
        return _MATMULS.get() == "int8" and self.fmt is not None and self.fmt.quantized

    def _quant(self) -> tuple[torch.Tensor, ...]:
        return quant_params(self) if self.fmt is not None and self.fmt.quantized else ()

    def _dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        if self.fmt.quantized:
            return dequantized(self.weight, self.fmt, self.scale, getattr(self, "min", None), dtype)
        return self.weight.to(dtype)


class Embedding(nn.Module):
    """``nn.Embedding`` whose table may be stored like a ``Linear``'s weight (a tied lm_head
    shares it): a lookup converts only the rows it reads."""

    stored: str | None = None
    fmt: WeightFormat | None = None

    def __init__(self, num: int, dim: int, dtype, device=None):
        super().__init__()
        self.dtype = dtype
        self.weight = nn.Parameter(torch.empty(num, dim, dtype=dtype, device=device))

    store_as = Linear.store_as

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = F.embedding(ids, self.weight)
        if self.fmt is None or not self.fmt.quantized:
            return rows.to(self.dtype)
        mins = getattr(self, "min", None)
        return dequantized(rows, self.fmt, self.scale[ids], None if mins is None else mins[ids], self.dtype)


GATE_UP = (Part("gate_proj", MLP_ROWS), Part("up_proj", MLP_ROWS))


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), gate and up as one matrix (``model/fused.py``);
    ``intermediate`` is this rank's share under tensor parallelism (the caller all-reduces the
    output)."""

    def __init__(
        self,
        spec: ModelSpec,
        dtype: torch.dtype,
        device=None,
        intermediate: int | None = None,
        kernels: bool = False,
    ):
        super().__init__()
        h, b = spec.hidden_size, spec.mlp_bias
        i = intermediate or spec.intermediate_size
        self.gate_up_proj = Linear(h, 2 * i, b, dtype, device, parts=GATE_UP, kernels=kernels)
        self.down_proj = Linear(i, h, b, dtype, device, shard=MLP_COLS, kernels=kernels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.gate_up_proj.swiglu(x))


def inv_freq(rope: RopeSpec, head_dim: int) -> torch.Tensor:
    """Rotary inverse frequencies in fp32, with linear or Llama-3 frequency scaling."""
    base = rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)
    freq = 1.0 / base
    if rope.kind == "linear":
        return freq / rope.factor
    if rope.kind == "llama3":
        low_wavelen = rope.original_max_position / rope.low_freq_factor
        high_wavelen = rope.original_max_position / rope.high_freq_factor
        wavelen = 2 * math.pi / freq
        scaled = torch.where(wavelen > low_wavelen, freq / rope.factor, freq)
        smooth = (rope.original_max_position / wavelen - rope.low_freq_factor) / (
            rope.high_freq_factor - rope.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled)
    return freq


def rope_tables(spec: ModelSpec, max_seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables [max_seq, head_dim] in fp32 (cast to the compute dtype at use), on the
    default device. Computed on the CPU: under a meta device context (meta_decoder) the ops would
    run through PyTorch's Python reference kernels, whose first call imports torch._dynamo
    (~0.9 s of a warm export)."""
    target = torch.get_default_device()
    with torch.device("cpu"):
        freq = inv_freq(spec.rope, spec.head_dim)
        pos = torch.arange(max_seq, dtype=torch.float32)
        angles = torch.outer(pos, freq)
        emb = torch.cat([angles, angles], dim=-1)
        return emb.cos().to(target), emb.sin().to(target)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos + rotate_half(x) * sin
