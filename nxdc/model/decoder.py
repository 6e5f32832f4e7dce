"""The shared decoder and its per-graph wrappers (context encoding, token generation,
speculation's verify, serving's single-row prefill).

Both wrappers hold the same ``Decoder`` under the same attribute name, so their exported
graphs name every weight and KV-cache buffer identically: the runtime loads each tensor once
and hands it to every graph as a user-managed constant.
"""

from __future__ import annotations

import torch
from torch import nn

from nxdc.model.attention import Attention
from nxdc.model.layers import MLP, Embedding, Linear, RMSNorm, decode_matmuls, prefill_matmuls, rope_tables
from nxdc.model.moe import MoE
from nxdc.model.parallel import all_gather_last, all_reduce
from nxdc.model.sharding import VOCAB_ROWS, ShardLayout, shard_layout
from nxdc.model.weight_format import module_format
from nxdc.spec import ModelSpec

# The names an export's weights and graphs use are the Decoder's own (graph constants carry the
# wrappers' ``GRAPH_PREFIX``); the exporter and the runtime take them from here.
GRAPH_PREFIX = "model."  # every graph wrapper holds the decoder as ``.model``
# a tied lm_head is the embedding: its weight and, when quantized, its scales and mins
TIED = {
    "lm_head.weight": "embed_tokens.weight",
    "lm_head.scale": "embed_tokens.scale",
    "lm_head.min": "embed_tokens.min",
}


def kv_cache_names(spec: ModelSpec) -> list[str]:
    """The KV-cache buffers, two per layer (``Attention.k_cache`` / ``v_cache``)."""
    return [f"layers.{i}.self_attn.{kind}" for i in range(spec.num_layers) for kind in ("k_cache", "v_cache")]


def tie_lm_head(state: dict[str, torch.Tensor], rows=lambda t: t) -> None:
    """Fill a tied lm_head (and its scales and mins) in ``state`` from the embedding; ``rows`` cuts
    this rank's vocabulary rows out of it (tensor parallelism)."""
    for head, embed in TIED.items():
        if embed in state:
            state[head] = rows(state[embed])


def runtime_constants(spec: ModelSpec, max_seq: int, rank: int, tp: int, device) -> dict[str, torch.Tensor]:
    """The non-persistent buffers a loaded graph is handed: rope tables, and this rank's index."""
    cos, sin = rope_tables(spec, max_seq)
    out = {"rope_cos": cos.to(device), "rope_sin": sin.to(device)}
    if tp > 1:
        out["tp_rank"] = torch.tensor([rank], dtype=torch.int64, device=device)
    return out


class DecoderLayer(nn.Module):
    def __init__(
        self,
        spec: ModelSpec,
        layout: ShardLayout,
        batch: int,
        max_seq: int,
        dtype,
        device=None,
        kv_dtype=None,
        kernels: bool = False,
        functional_kv: bool = False,
    ):
        super().__init__()
        self.tp = layout.tp
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, dtype, device)
        self.self_attn = Attention(
            spec, layout, batch, max_seq, dtype, device, kv_dtype, kernels, functional_kv
        )
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, dtype, device)
        if spec.is_moe:  # sparse experts in place of the MLP (same name, same all-reduce)
            self.mlp = MoE(spec, layout, dtype, device, kernels=kernels)
        else:
            self.mlp = MLP(spec, dtype, device, intermediate=layout.intermediate, kernels=kernels)

    def forward(self, h, cos, sin, positions, mask, kv_len, rows=None, keep=None):
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, positions, mask, kv_len, rows, keep)
        return h + all_reduce(self.mlp(self.post_attention_layernorm(h)), self.tp)


class Decoder(nn.Module):
    """One rank's decoder (the whole model at tp 1): replicated embedding and norms, this
    rank's heads / MLP columns / vocabulary rows (``layout``).

    Modes, fixed at construction: ``kernels`` routes linear layers and attention to nxdc's CPU
    kernels (decided at export: ``compile/trace.py``); ``kv_update`` ``"functional"`` writes the
    KV caches out of place and re-assigns them (graphs wrapped in ``FunctionalKV`` return them),
    ``"in-place"`` writes them with ``index_copy_``; ``prefill_matmul`` (``--prefill-matmul``)
    lets the prefill graphs' linear layers multiply on bf16 tiles (``prefill_matmuls``);
    ``decode_int8`` lets the decode and verify graphs' int4 layers multiply int8-quantized
    activations (``decode_matmuls``)."""

    KV_UPDATES = ("in-place", "functional")

    def __init__(
        self,
        spec: ModelSpec,
        batch: int,
        max_seq: int,
        dtype: torch.dtype,
        device=None,
        layout: ShardLayout | None = None,
        weights: str | None = None,
        kv_dtype: torch.dtype | None = None,  # the KV cache's storage (None: dtype)
        weight_map: dict[str, str] | None = None,  # weights "gguf": each module's format
        kernels: bool = False,
        kv_update: str = "in-place",
        prefill_matmul: str = "exact",
        decode_int8: bool = False,
    ):
        super().__init__()
        if kv_update not in self.KV_UPDATES:
            raise ValueError(f"kv_update must be one of {self.KV_UPDATES} (got {kv_update!r})")
        self.kernels, self.kv_update, self.prefill_matmul = kernels, kv_update, prefill_matmul
        self.decode_int8 = decode_int8
        layout = layout or shard_layout(spec, 1)
        self.spec, self.batch, self.max_seq, self.tp, self.layout = spec, batch, max_seq, layout.tp, layout
        self.embed_tokens = Embedding(spec.vocab_size, spec.hidden_size, dtype, device)
        self.layers = nn.ModuleList(
            DecoderLayer(
                spec, layout, batch, max_seq, dtype, device, kv_dtype, kernels, kv_update == "functional"
            )
            for _ in range(spec.num_layers)
        )
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, dtype, device)
        self.lm_head = Linear(
            spec.hidden_size, layout.vocab, False, dtype, device, shard=VOCAB_ROWS, kernels=kernels
        )
        if weights is not None:  # --weights (model/weight_format.py): stored formats (norms, routers: dtype)
            for name, m in self.named_modules():
                fmt = module_format(weights, name, weight_map)
                if isinstance(m, (Linear, Embedding)) and not name.endswith("router") and fmt is not None:
                    m.store_as(fmt)
        if spec.tie_word_embeddings and layout.tp == 1:
            self.lm_head.weight = self.embed_tokens.weight
            for p in ("scale", "min"):  # quantized: the same scales and mins
                if hasattr(self.embed_tokens, p):
                    setattr(self.lm_head, p, getattr(self.embed_tokens, p))
        cos, sin = rope_tables(spec, max_seq)
        self.register_buffer("rope_cos", cos.to(device), persistent=False)
        self.register_buffer("rope_sin", sin.to(device), persistent=False)
        if layout.tp > 1:  # this rank's index, bound per rank at run time (all_gather_last)
            self.register_buffer(
                "tp_rank", torch.zeros(1, dtype=torch.int64, device=device), persistent=False
            )

    def stored_state(self) -> dict[str, torch.Tensor]:
        """What an export writes for this rank: every weight, but not the KV caches (the runtime
        allocates them: ``kv_cache_names``) nor a tied lm_head (sliced from the embedding when
        loaded: ``tie_lm_head``). Rope tables and ``tp_rank`` are not persistent buffers."""
        runtime = set(kv_cache_names(self.spec))
        out = {n: t for n, t in self.state_dict().items() if n not in runtime}
        if self.spec.tie_word_embeddings:
            for name in TIED:
                out.pop(name, None)
        return out

    def forward(
        self,
        input_ids: torch.Tensor,  # [B, T]
        positions: torch.Tensor,  # [B, T]
        mask: torch.Tensor,  # bool [B or 1, 1, T, S_attended]
        kv_len: int | None,
        last_index: torch.Tensor | None,  # [B]: which of the T positions to score (None: the last)
        every_position: bool = False,  # score all T positions: logits [B, T, vocab]
        rows: torch.Tensor | None = None,  # [B] the KV cache's batch row of each sequence (None: b)
        keep: torch.Tensor | None = None,  # bool [B, T]: tokens whose keys / values are written
    ) -> torch.Tensor:
        h = self.embed_tokens(input_ids)
        cos = self.rope_cos[positions].to(h.dtype).unsqueeze(1)
        sin = self.rope_sin[positions].to(h.dtype).unsqueeze(1)
        for layer in self.layers:
            h = layer(h, cos, sin, positions, mask, kv_len, rows, keep)
        if every_position:
            pass
        elif last_index is None:
            h = h[:, -1]
        else:
            h = h[torch.arange(h.shape[0], device=h.device), last_index]
        logits = all_gather_last(self.lm_head(self.norm(h)), self.tp, getattr(self, "tp_rank", None))
        return logits[..., : self.spec.vocab_size].float()


class FunctionalKV(nn.Module):
    """A graph wrapper whose decoder writes its KV caches functionally (``kv_update="functional"``):
    it returns ``(logits, *new caches)`` in ``kv_cache_names`` order and leaves the decoder's
    buffers as they were. It holds the decoder as ``.model`` too (not the wrapped graph, which
    would prefix every name), so its constants are named like every other graph's."""

    def __init__(self, graph: nn.Module):
        super().__init__()
        self.model = graph.model
        object.__setattr__(self, "graph", graph)  # not a submodule: see above

    def forward(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        names = kv_cache_names(self.model.spec)
        before = [self.model.get_buffer(n) for n in names]
        try:
            logits = self.graph(*inputs)
            return (logits, *[self.model.get_buffer(n) for n in names])
        finally:
            for name, t in zip(names, before, strict=True):
                owner, _, attr = name.rpartition(".")
                setattr(self.model.get_submodule(owner), attr, t)


class ContextEncoding(nn.Module):
    """Prefill graph for one bucket: fresh prompts (right-padded to T) -> last-token logits."""

    def __init__(self, model: Decoder):
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, last_index: torch.Tensor) -> torch.Tensor:
        bsz, t = input_ids.shape
        pos = torch.arange(t, device=input_ids.device)
        positions = pos.unsqueeze(0).expand(bsz, t)
        mask = (pos.view(1, t) <= pos.view(t, 1)).view(1, 1, t, t)
        with prefill_matmuls(self.model.prefill_matmul):
            return self.model(input_ids, positions, mask, None, last_index)


class TokenGeneration(nn.Module):
    """Decode graph: one new token per sequence at its own position, attending to
    ``kv_len`` cache slots. A negative position marks an idle batch row: its cache is not
    written and its logits are meaningless. With ``rows`` (serving, fewer sequences than the
    batch) sequence i is the cache's batch row ``rows[i]``."""

    def __init__(self, model: Decoder, kv_len: int):
        super().__init__()
        self.model = model
        self.kv_len = kv_len

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor | None = None
    ) -> torch.Tensor:
        keep = positions.view(-1, 1) >= 0
        positions = positions.clamp(min=0)
        slots = torch.arange(self.kv_len, device=input_ids.device)
        mask = slots.view(1, 1, 1, -1) <= positions.view(-1, 1, 1, 1)
        with decode_matmuls(self.model.decode_int8):
            return self.model(input_ids, positions.view(-1, 1), mask, self.kv_len, None, rows=rows, keep=keep)


class Verify(nn.Module):
    """Speculation's verify graph: ``k + 1`` tokens per sequence (the last accepted token and
    ``k`` draft tokens) at consecutive positions from ``start``, attending to ``kv_len`` cache
    slots, scored at every position: logits [B, k + 1, vocab]. It writes their keys/values into
    the cache; slots past a rejected draft token are never read (the mask only reaches a
    query's own position) and the next call overwrites them. A negative ``start`` marks an
    idle batch row, whose cache is not written."""

    def __init__(self, model: Decoder, kv_len: int, k: int):
        super().__init__()
        self.model = model
        self.kv_len, self.k = kv_len, k

    def forward(self, input_ids: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
        steps = torch.arange(self.k + 1, device=input_ids.device).view(1, -1)
        keep = (start.view(-1, 1) >= 0).expand(-1, self.k + 1)
        positions = torch.where(keep, start.view(-1, 1) + steps, steps)
        slots = torch.arange(self.kv_len, device=input_ids.device)
        mask = (slots.view(1, 1, -1) <= positions.unsqueeze(-1)).unsqueeze(1)  # [B, 1, k+1, S]
        with decode_matmuls(self.model.decode_int8):
            return self.model(input_ids, positions, mask, self.kv_len, None, every_position=True, keep=keep)


class RowPrefill(nn.Module):
    """Serving's prefill graph: up to ``length`` prompt tokens of one sequence, written into
    batch row ``rows[0]`` of the KV cache from position ``start`` (``start > 0``: a later chunk
    of a long prompt, or a prompt whose first ``start`` tokens the row already holds), attending
    to that row's earlier slots too; the logits of token ``last_index``. Every other row's
    cache, and the row's slots outside the real tokens, keep their bytes: padding past
    ``last_index`` writes nothing (a pad whose position would fall past the cache is put
    ``length`` slots earlier, below ``start``, where no real token of the call writes)."""

    def __init__(self, model: Decoder, length: int):
        super().__init__()
        self.model = model
        self.length = length

    def forward(
        self, input_ids: torch.Tensor, rows: torch.Tensor, start: torch.Tensor, last_index: torch.Tensor
    ) -> torch.Tensor:
        n, s = self.length, self.model.max_seq
        steps = torch.arange(n, device=input_ids.device).view(1, n)
        keep = steps <= last_index.view(1, 1)
        positions = start.view(1, 1) + steps
        positions = torch.where(positions < s, positions, positions - n)
        slots = torch.arange(s, device=input_ids.device)
        mask = (slots.view(1, 1, -1) <= positions.unsqueeze(-1)).unsqueeze(1)  # [1, 1, n, S]
        with prefill_matmuls(self.model.prefill_matmul):
            return self.model(input_ids, positions, mask, s, last_index, rows=rows, keep=keep)
