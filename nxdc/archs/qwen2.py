"""Qwen2 / Qwen2.5: Llama's layout with q/k/v biases (no o bias)."""

from __future__ import annotations

from typing import Any

from nxdc.archs import register
from nxdc.archs.llama import LlamaLike, llama_spec
from nxdc.spec import ModelSpec


@register("qwen2")
class Qwen2(LlamaLike):
    name = "qwen2"

    def spec_from_config(self, cfg: dict[str, Any]) -> ModelSpec:
        return llama_spec(cfg, self.name, qkv_bias=True)
