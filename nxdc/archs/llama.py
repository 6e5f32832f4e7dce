"""Llama family (Llama 2/3/3.1/3.2, SmolLM2, ...): config mapping and weight names."""

from __future__ import annotations

from typing import Any

from nxdc.archs import register
from nxdc.errors import UnsupportedError
from nxdc.spec import ModelSpec, eos_ids, rope_from_config


@register("llama")
class Llama:
    name = "llama"

    def spec_from_config(self, cfg: dict[str, Any]) -> ModelSpec:
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise UnsupportedError(f"llama with hidden_act={act!r} is not supported (only silu)")
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        return ModelSpec(
            arch="llama",
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope=rope_from_config(cfg),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", False)),
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids(cfg),
        )

    def weight_name(self, hf_name: str) -> str | None:
        """HF checkpoint name -> nxdc module name (None: not a weight we load)."""
        if hf_name.endswith("rotary_emb.inv_freq"):
            return None
        if hf_name.startswith("model."):
            return hf_name[len("model.") :]
        if hf_name == "lm_head.weight":
            return hf_name
        return None
