"""Shared decoder pieces: RMSNorm, rotary embeddings (incl. Llama-3 scaling), SwiGLU MLP."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from nxdc.kernels import MAX_ROWS
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


class Linear(nn.Module):
    """``nn.Linear``'s parameters (``weight [out, in]``, optional ``bias``) with a choice of
    kernel: when ``skinny`` is set (fp32 on CPU, decided at export) and the input has at most
    ``MAX_ROWS`` rows — a decode step — it calls nxdc's memory-bound matvec kernel."""

    skinny = False  # set per instance by the exporter / runtime builder

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype, device=None):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype, device=device))
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        k = x.shape[-1]
        rows = x.numel() // k
        if self.skinny and rows <= MAX_ROWS and x.dtype == torch.float32 and k % 8 == 0:
            y = torch.ops.nxdc.skinny_linear(x.reshape(rows, k), self.weight)
            y = y.view(*x.shape[:-1], self.weight.shape[0])
            return y + self.bias if self.bias is not None else y
        return F.linear(x, self.weight, self.bias)


def use_skinny_kernels(model: nn.Module, enabled: bool = True) -> None:
    for m in model.modules():
        if isinstance(m, Linear):
            m.skinny = enabled


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)); ``intermediate`` is this rank's share under tensor
    parallelism (the caller all-reduces the output)."""

    def __init__(self, spec: ModelSpec, dtype: torch.dtype, device=None, intermediate: int | None = None):
        super().__init__()
        h, b = spec.hidden_size, spec.mlp_bias
        i = intermediate or spec.intermediate_size
        self.gate_proj = Linear(h, i, b, dtype, device)
        self.up_proj = Linear(h, i, b, dtype, device)
        self.down_proj = Linear(i, h, b, dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


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
    """cos/sin tables [max_seq, head_dim] in fp32 (cast to the compute dtype at use)."""
    freq = inv_freq(spec.rope, spec.head_dim)
    pos = torch.arange(max_seq, dtype=torch.float32)
    angles = torch.outer(pos, freq)
    emb = torch.cat([angles, angles], dim=-1)
    return emb.cos(), emb.sin()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos + rotate_half(x) * sin
