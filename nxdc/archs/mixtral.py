"""Mixtral (8x7B, 8x22B): Llama's attention with a sparse MoE block in place of the MLP
(``nxdc.model.moe``): softmax router, top-k experts, weights always renormalised.

Checkpoint names: ``model.layers.N.block_sparse_moe.gate.weight`` (router) and
``...block_sparse_moe.experts.E.w1/w3/w2.weight`` (gate/up/down of expert E)."""

from __future__ import annotations

import re
from typing import Any

from nxdc.archs import register
from nxdc.archs.llama import LlamaLike, llama_spec
from nxdc.spec import ModelSpec

_EXPERT = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


@register("mixtral")
class Mixtral(LlamaLike):
    name = "mixtral"

    def spec_from_config(self, cfg: dict[str, Any]) -> ModelSpec:
        return llama_spec(
            cfg,
            self.name,
            num_experts=int(cfg["num_local_experts"]),
            experts_per_token=int(cfg["num_experts_per_tok"]),
            moe_intermediate_size=int(cfg["intermediate_size"]),
            norm_topk_prob=True,
        )

    def weight_name(self, hf_name: str) -> str | None:
        name = super().weight_name(hf_name)
        if name is None or ".block_sparse_moe." not in name:
            return name
        name = name.replace(".block_sparse_moe.", ".mlp.")
        if name.endswith(".mlp.gate.weight"):
            return name.replace(".mlp.gate.", ".mlp.router.")
        m = re.fullmatch(r"(.*\.experts\.\d+)\.(w[123])\.weight", name)
        return f"{m.group(1)}.{_EXPERT[m.group(2)]}.weight" if m else None
