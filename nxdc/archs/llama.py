"""Llama family (Llama 2/3/3.1/3.2, SmolLM2, ...): config mapping and weight names.

``llama_spec`` and ``LlamaLike`` are the shared base of every Llama-shaped architecture
(Mistral, Mixtral, Qwen2/3, ...): their files add only what differs."""

from __future__ import annotations

import re
from typing import Any

from nxdc.archs import register
from nxdc.errors import UnsupportedError
from nxdc.spec import ModelSpec, eos_ids, rope_from_config, sliding_window_from_config


def llama_spec(cfg: dict[str, Any], arch: str, **extra: Any) -> ModelSpec:
    """The ModelSpec fields that Llama-shaped configs spell the same way; ``extra`` sets or
    overrides the rest (biases, q/k norm, experts)."""
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise UnsupportedError(f"{arch} with hidden_act={act!r} is not supported (only silu)")
    heads = int(cfg["num_attention_heads"])
    hidden = int(cfg["hidden_size"])
    fields: dict[str, Any] = dict(
        arch=arch,
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
        sliding_window=sliding_window_from_config(cfg),
    )
    fields.update(extra)
    experts, k = fields.get("num_experts", 0), fields.get("experts_per_token", 0)
    if experts and not 1 <= k <= experts:
        raise UnsupportedError(f"{arch}: num_experts_per_tok={k} must be between 1 and {experts}")
    return ModelSpec(**fields)


class LlamaLike:
    """Checkpoint names as Llama's (``model.layers.N.self_attn.q_proj.weight`` ...): drop the
    ``model.`` prefix; subclasses rename what their checkpoints spell differently."""

    name = "llama"
    gguf = False  # True where weights/gguf_source.py maps its GGUF names and q/k permutation

    def spec_from_config(self, cfg: dict[str, Any]) -> ModelSpec:
        return llama_spec(cfg, self.name)

    def weight_name(self, hf_name: str) -> str | None:
        """HF checkpoint name -> nxdc module name (None: not a weight we load)."""
        if hf_name.endswith("rotary_emb.inv_freq"):
            return None
        if hf_name.startswith("model."):
            return hf_name[len("model.") :]
        if hf_name == "lm_head.weight":
            return hf_name
        return None

    def hf_name(self, name: str) -> str:
        """The model's name -> the HF checkpoint's (the inverse of ``weight_name`` for the names
        both spell alike: ``--compare transformers`` rebuilds the HF model from an export)."""
        return name if name.startswith("lm_head.") else f"model.{name}"

    def gguf_name(self, gguf_name: str) -> str | None:
        """GGUF tensor name -> HF checkpoint name (None: skipped); only where ``gguf``."""
        return None

    def gguf_permuted(self, hf_name: str) -> bool:
        """Whether llama.cpp stored this tensor's rows permuted per head (its q and k)."""
        return hf_name.endswith(("q_proj.weight", "k_proj.weight"))


# llama.cpp's tensor names for Llama-shaped models (its q/k rows are permuted per head:
# weights/gguf_source.py undoes that)
GGUF_LAYER = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
GGUF_GLOBAL = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


@register("llama")
class Llama(LlamaLike):
    name = "llama"
    gguf = True

    def gguf_name(self, gguf_name: str) -> str | None:
        base, _, suffix = gguf_name.rpartition(".")  # "rope_freqs" and the like: recomputed
        if base in GGUF_GLOBAL:
            return f"{GGUF_GLOBAL[base]}.{suffix}"
        m = re.fullmatch(r"blk\.(\d+)\.(\w+)", base)
        if m and m.group(2) in GGUF_LAYER:
            return f"model.layers.{m.group(1)}.{GGUF_LAYER[m.group(2)]}.{suffix}"
        return None
