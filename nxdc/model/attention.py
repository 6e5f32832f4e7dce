"""GQA attention over a static, in-place-updated KV cache.

Layout: ``k_cache``/``v_cache`` are ``[batch, kv_heads, max_seq, head_dim]`` buffers (this
rank's KV heads under tensor parallelism). New
keys/values are written with ``index_copy_`` into a flattened row view (row-only writes,
never a whole-cache copy), at per-sequence positions. Serving graphs name the cache's batch
rows they work on (``rows``), and a token that is not ``keep`` (an idle batch row, a prefill
chunk's padding) writes back the bytes its slot already holds: the cache is left as it was. Queries are regrouped as
``[batch, kv_heads, group * T, head_dim]`` so every KV head serves its query group without
expanding the cache (no ``repeat_interleave``).

``functional_kv`` (the decoder's ``kv_update="functional"``): the write is out of place (``index_copy``) and the
new cache is re-assigned to the buffer attribute, the form NxD's ModelBuilder and XLA need (they
alias it to the input); ``FunctionalKV`` (decoder.py) returns it from the graph.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from nxdc.model.layers import KERNEL_DTYPES, Linear, RMSNorm, apply_rope
from nxdc.model.parallel import all_reduce
from nxdc.model.sharding import HEAD_COLS, KV_HEADS, Q_HEADS, Part, ShardLayout
from nxdc.spec import ModelSpec

QKV = (Part("q_proj", Q_HEADS), Part("k_proj", KV_HEADS), Part("v_proj", KV_HEADS))


class Attention(nn.Module):
    def __init__(
        self,
        spec: ModelSpec,
        layout: ShardLayout,
        batch: int,
        max_seq: int,
        dtype: torch.dtype,
        device=None,
        kv_dtype: torch.dtype | None = None,  # the cache's storage (--kv-cache); None: dtype
        kernels: bool = False,  # nxdc::attend for prefill, decode and verify (on CPU)
        functional_kv: bool = False,  # write the cache out of place and re-assign it
    ):
        super().__init__()
        self.kernels, self.functional_kv = kernels, functional_kv
        # this rank's heads (all of them at tp 1); o_proj's partial sums meet in an all-reduce
        self.n_heads, self.n_kv, self.head_dim = layout.heads, layout.kv, spec.head_dim
        self.tp = layout.tp
        self.max_seq = max_seq
        h, d, b = spec.hidden_size, spec.head_dim, spec.attention_bias
        self.splits = (self.n_heads * d, self.n_kv * d, self.n_kv * d)
        qkv_bias = b or spec.qkv_bias  # Qwen2: q/k/v biases, no o bias
        self.qkv_proj = Linear(h, sum(self.splits), qkv_bias, dtype, device, parts=QKV, kernels=kernels)
        self.o_proj = Linear(self.n_heads * d, h, b, dtype, device, shard=HEAD_COLS, kernels=kernels)
        if spec.qk_norm:  # Qwen3: RMSNorm over head_dim of every q and k head, before RoPE
            self.q_norm = RMSNorm(d, spec.rms_norm_eps, dtype, device)
            self.k_norm = RMSNorm(d, spec.rms_norm_eps, dtype, device)
        else:
            self.q_norm = self.k_norm = None
        shape = (batch, self.n_kv, max_seq, d)
        kv_dtype = kv_dtype or dtype
        self.register_buffer("k_cache", torch.zeros(shape, dtype=kv_dtype, device=device), persistent=True)
        self.register_buffer("v_cache", torch.zeros(shape, dtype=kv_dtype, device=device), persistent=True)

    def _write(
        self,
        cache: torch.Tensor,
        new: torch.Tensor,
        positions: torch.Tensor,
        rows: torch.Tensor | None,
        keep: torch.Tensor | None,
    ) -> torch.Tensor:
        """The cache with ``new`` written at ``positions``: ``cache`` itself, or (functional_kv)
        a new tensor."""
        bsz, n_kv, t, d = new.shape
        seq = rows if rows is not None else torch.arange(bsz, device=new.device)
        heads = seq.view(bsz, 1, 1) * n_kv + torch.arange(n_kv, device=new.device).view(1, n_kv, 1)
        idx = (heads * self.max_seq + positions.view(bsz, 1, t)).reshape(-1)
        flat = cache.view(-1, d)
        src = new.reshape(-1, d).to(cache.dtype)
        if keep is not None:
            written = keep.view(bsz, 1, t, 1).expand(bsz, n_kv, t, 1).reshape(-1, 1)
            src = torch.where(written, src, flat.index_select(0, idx))
        if self.functional_kv:
            return flat.index_copy(0, idx, src).view(cache.shape)
        flat.index_copy_(0, idx, src)
        return cache

    def forward(
        self,
        x: torch.Tensor,  # [B, T, hidden]
        cos: torch.Tensor,  # [B, 1, T, head_dim]
        sin: torch.Tensor,
        positions: torch.Tensor,  # [B, T] cache slot of each new token
        mask: torch.Tensor,  # bool [B or 1, 1, T, S_attended]
        kv_len: int | None,  # None: attend to the new tokens only (fresh prefill)
        rows: torch.Tensor | None = None,  # [B] the cache's batch row of each sequence (None: b)
        keep: torch.Tensor | None = None,  # bool [B, T]: tokens whose keys / values are written
    ) -> torch.Tensor:
        bsz, t, _ = x.shape
        d, n_kv = self.head_dim, self.n_kv
        group = self.n_heads // n_kv
        q, k, v = self.qkv_proj(x).split(self.splits, dim=-1)
        q = q.view(bsz, t, self.n_heads, d).transpose(1, 2)
        k = k.view(bsz, t, n_kv, d).transpose(1, 2)
        v = v.view(bsz, t, n_kv, d).transpose(1, 2)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rope(q, cos, sin)
        k = apply_rope(k, cos, sin)
        k_cache = self._write(self.k_cache, k, positions, rows, keep)
        v_cache = self._write(self.v_cache, v, positions, rows, keep)
        if self.functional_kv:  # re-assigned, never written in place
            self.k_cache, self.v_cache = k_cache, v_cache
        # [B, Hq, T, D] -> [B, Hkv, G*T, D]: query heads kv*G .. kv*G+G-1 share KV head kv.
        qg = q.reshape(bsz, n_kv, group * t, d)
        if self.kernels and q.dtype in KERNEL_DTYPES and d % 8 == 0:
            # each row reads only the slots up to its own position (the mask): decode, verify, and
            # a fresh prefill, whose keys / values are in the cache by now (and whose mask is causal);
            # fp16 / bf16 queries (--dtype) in as fp32, the output rounded back
            out = torch.ops.nxdc.attend(qg.float(), self.k_cache, self.v_cache, positions, rows).to(q.dtype)
        else:
            if kv_len is None:  # the new keys / values as the cache holds them (--kv-cache rounds)
                keys, values = k.to(self.k_cache.dtype), v.to(self.v_cache.dtype)
            elif rows is not None:  # a copy of the rows' slots (the kernel reads them in place)
                keys = self.k_cache[:, :, :kv_len].index_select(0, rows)
                values = self.v_cache[:, :, :kv_len].index_select(0, rows)
            else:
                keys, values = self.k_cache[:, :, :kv_len], self.v_cache[:, :, :kv_len]
            keys, values = keys.to(q.dtype), values.to(q.dtype)
            s = mask.shape[-1]
            gmask = mask.unsqueeze(2).expand(mask.shape[0], 1, group, t, s).reshape(-1, 1, group * t, s)
            out = F.scaled_dot_product_attention(qg, keys, values, attn_mask=gmask)
        out = out.reshape(bsz, self.n_heads, t, d).transpose(1, 2).reshape(bsz, t, -1)
        return all_reduce(self.o_proj(out), self.tp)
