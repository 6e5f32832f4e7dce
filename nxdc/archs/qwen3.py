"""Qwen3 (dense): Llama's layout with an RMSNorm over head_dim on every q and k head before
RoPE (``self_attn.q_norm`` / ``k_norm``, one weight shared by the heads); no q/k/v bias
unless ``attention_bias``."""

from __future__ import annotations

from typing import Any

from nxdc.archs import register
from nxdc.archs.llama import LlamaLike, llama_spec
from nxdc.spec import ModelSpec


@register("qwen3")
class Qwen3(LlamaLike):
    name = "qwen3"

    def spec_from_config(self, cfg: dict[str, Any]) -> ModelSpec:
        return llama_spec(cfg, self.name, qk_norm=True)
