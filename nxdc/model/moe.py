"""Sparse mixture-of-experts block (Mixtral, Qwen3-MoE): a softmax router picks the top-k of
E SwiGLU experts per token and sums their outputs weighted by the (renormalised) router
probabilities.

Routing follows transformers op for op: router logits in the model dtype, softmax in fp32,
``topk``, then division by the top-k sum when the config says so (Mixtral always,
Qwen3-MoE when ``norm_topk_prob``). The weighted sum over the k experts is taken in fp32 and
cast to the model dtype once.

Weights are stacked, one parameter per kind: ``experts.gate_up_proj.weight [E, 2*I, hidden]``
(each expert's gate rows, then its up rows) and ``experts.down_proj.weight [E, hidden, I]``,
built at export from the checkpoint's per-expert matrices (``model/fused.py``). Under tensor
parallelism every expert's gate/up is column-parallel and its down row-parallel over the
expert intermediate size (``expert_intermediate``), the router is replicated (every rank
routes identically), and the block's partial sums meet in the decoder layer's one all-reduce.

Static shapes. The graph never branches on routing results: one of three paths is chosen at
trace time from the token count N (static), the dtype and the device.
- ``gather`` (N*k <= 2E, i.e. decode; on CUDA only when ``grouped`` cannot serve): each
  (token, expert) pair's matrices are gathered by index and applied as a batched mat-vec.
  Reads the k chosen experts (and writes/reads the gathered copy) instead of all E.
- ``grouped`` (bf16 prefill; every bf16 graph on CUDA): the N*k pairs are sorted by expert and
  one ``torch._grouped_mm`` per projection multiplies each expert's rows by that expert's
  weights: only chosen experts are read and the FLOPs are k/E of dense. Group sizes are data
  (an offsets tensor), never shapes. ``_grouped_mm`` traces only in bf16 and needs rows of
  whole 16-byte units (hidden size and this rank's expert size multiples of 8, true of every
  published MoE); otherwise ``dense`` serves.
- ``dense`` (fp32 prefill): every expert runs on every token and the outputs are weighted by
  the routing weights, zero for experts not chosen: E/k times the FLOPs, but plain batched
  GEMMs.
On CPU (2 cores, inductor-compiled, Mixtral-8x7B and Qwen3-30B-A3B per-rank shapes) gather
beats dense up to about N*k = 2E and loses from 4E; aten's CPU ``_grouped_mm`` is slow for a
few rows per expert (bf16 mat-vecs) but 2-5x faster than dense at prefill sizes. On CUDA the
grouped GEMM reads only the chosen experts with no copy (one CUTLASS kernel on sm90/sm100;
torch's per-expert fallback elsewhere), so it serves every size there (not measured: CI has no
GPU). Measurements behind this choice are in docs/architectures.md.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from nxdc.model.layers import Linear
from nxdc.model.sharding import EXPERT_COLS, EXPERT_ROWS, Part, ShardLayout, expert_intermediate
from nxdc.spec import ModelSpec


class StackedWeight(nn.Module):
    """E matrices ``weight [E, out, in]``, one per expert, each made of the checkpoint's
    ``parts`` of that expert (in row order)."""

    def __init__(
        self, experts: int, in_features: int, out_features: int, parts: tuple[Part, ...], dtype, device=None
    ):
        super().__init__()
        self.experts, self.parts = experts, parts
        self.weight = nn.Parameter(
            torch.empty(experts, out_features, in_features, dtype=dtype, device=device)
        )


class Experts(nn.Module):
    def __init__(self, experts: int, hidden: int, intermediate: int, dtype, device=None):
        super().__init__()
        gate_up = (Part("gate_proj", EXPERT_ROWS), Part("up_proj", EXPERT_ROWS))
        self.gate_up_proj = StackedWeight(experts, hidden, 2 * intermediate, gate_up, dtype, device)
        down = (Part("down_proj", EXPERT_COLS),)
        self.down_proj = StackedWeight(experts, intermediate, hidden, down, dtype, device)


class MoE(nn.Module):
    """This rank's share of a sparse MoE block; the caller all-reduces the output."""

    def __init__(
        self, spec: ModelSpec, layout: ShardLayout, dtype: torch.dtype, device=None, kernels: bool = False
    ):
        super().__init__()
        h, e = spec.hidden_size, spec.num_experts
        self.num_experts, self.top_k, self.renormalize = e, spec.experts_per_token, spec.norm_topk_prob
        self.router = Linear(h, e, False, dtype, device, kernels=kernels)
        self.experts = Experts(e, h, expert_intermediate(spec, layout.tp), dtype, device)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k routing weights (fp32) and expert indices, both [N, k]."""
        probs = F.softmax(self.router(x).float(), dim=-1)
        weights, index = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, index

    def path(self, n_tokens: int, dtype: torch.dtype, device: str = "cpu") -> str:
        """The expert path for ``n_tokens`` tokens (decided at trace time; module docstring)."""
        _, i2, h = self.experts.gate_up_proj.weight.shape
        grouped = dtype == torch.bfloat16 and h % 8 == 0 and (i2 // 2) % 8 == 0  # 16-byte rows
        if grouped and device == "cuda":
            return "grouped"
        if n_tokens * self.top_k <= 2 * self.num_experts:
            return "gather"
        return "grouped" if grouped else "dense"

    def forward(self, x: torch.Tensor, path: str | None = None) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        weights, index = self.route(x)
        path = path or self.path(x.shape[0], x.dtype, x.device.type)
        y = {"grouped": self._grouped, "gather": self._gather, "dense": self._dense}[path](x, weights, index)
        return y.to(x.dtype).view(shape)

    def _swiglu(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def _grouped(self, x: torch.Tensor, weights: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        n, h = x.shape
        k = self.top_k
        flat = index.reshape(-1)  # [N*k] expert of each (token, slot) pair
        order = torch.argsort(flat, stable=True)
        experts = torch.arange(self.num_experts, device=x.device, dtype=flat.dtype)
        ends = torch.searchsorted(flat[order], experts, right=True).to(torch.int32)  # group ends
        rows = x[order // k]  # pair rows grouped by expert
        w = self.experts
        act = self._swiglu(torch._grouped_mm(rows, w.gate_up_proj.weight.transpose(1, 2), offs=ends))
        out = torch._grouped_mm(act, w.down_proj.weight.transpose(1, 2), offs=ends)
        unsort = torch.empty_like(order).scatter_(0, order, torch.arange(n * k, device=x.device))
        out = out[unsort].view(n, k, h)
        return (out.float() * weights.unsqueeze(-1)).sum(dim=1)

    def _gather(self, x: torch.Tensor, weights: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        n, h = x.shape
        k = self.top_k
        flat = index.reshape(-1)
        rows = x.unsqueeze(1).expand(n, k, h).reshape(n * k, h, 1)
        w = self.experts
        act = self._swiglu(torch.bmm(w.gate_up_proj.weight[flat], rows).squeeze(-1))
        out = torch.bmm(w.down_proj.weight[flat], act.unsqueeze(-1)).view(n, k, h)
        return (out.float() * weights.unsqueeze(-1)).sum(dim=1)

    def _dense(self, x: torch.Tensor, weights: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        w = self.experts
        act = self._swiglu(torch.matmul(x, w.gate_up_proj.weight.transpose(1, 2)))  # [E, N, I]
        out = torch.matmul(act, w.down_proj.weight.transpose(1, 2))  # [E, N, hidden]
        dense = torch.zeros(n, self.num_experts, dtype=weights.dtype, device=x.device)
        dense = dense.scatter(1, index, weights)  # [N, E]: zero for experts not chosen
        return (out.float() * dense.t().unsqueeze(-1)).sum(dim=0)
