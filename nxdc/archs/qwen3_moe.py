"""Qwen3-MoE (30B-A3B, 235B-A22B): Qwen3's attention (q/k norm) with a sparse MoE block
(``nxdc.model.moe``); the top-k weights are renormalised only when ``norm_topk_prob``.

Checkpoint names: ``model.layers.N.mlp.gate.weight`` (router) and
``...mlp.experts.E.gate_proj/up_proj/down_proj.weight``. Configs that keep some layers dense
(``mlp_only_layers``, ``decoder_sparse_step`` > 1; no published checkpoint does) are refused."""

from __future__ import annotations

from typing import Any

from nxdc.archs import register
from nxdc.archs.llama import LlamaLike, llama_spec
from nxdc.errors import UnsupportedError
from nxdc.spec import ModelSpec


@register("qwen3_moe")
class Qwen3Moe(LlamaLike):
    name = "qwen3_moe"

    def spec_from_config(self, cfg: dict[str, Any]) -> ModelSpec:
        if cfg.get("mlp_only_layers") or int(cfg.get("decoder_sparse_step", 1)) != 1:
            raise UnsupportedError(
                "qwen3_moe with dense layers (mlp_only_layers / decoder_sparse_step > 1) is not "
                "supported: nxdc needs every layer to be a MoE layer"
            )
        experts = cfg.get("num_experts", cfg.get("num_local_experts"))
        return llama_spec(
            cfg,
            self.name,
            qk_norm=True,
            num_experts=int(experts),
            experts_per_token=int(cfg["num_experts_per_tok"]),
            moe_intermediate_size=int(cfg["moe_intermediate_size"]),
            norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
        )

    def weight_name(self, hf_name: str) -> str | None:
        name = super().weight_name(hf_name)
        if name is not None and name.endswith(".mlp.gate.weight"):
            return name.replace(".mlp.gate.", ".mlp.router.")
        return name
