"""ModelSpec: the architecture facts nxdc needs, mapped from a Hugging Face config."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

from nxdc.errors import UnsupportedError


@dataclass(frozen=True)
class RopeSpec:
    theta: float
    kind: str = "default"  # default | linear | llama3
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192


@dataclass(frozen=True)
class ModelSpec:
    arch: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeSpec
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False  # q/k/v/o biases (Llama's flag)
    mlp_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    # Fields below have defaults so that manifests written before they existed still load.
    qkv_bias: bool = False  # q/k/v biases without an o bias (Qwen2)
    qk_norm: bool = False  # RMSNorm over head_dim on each q and k head before RoPE (Qwen3)
    sliding_window: int | None = None  # None: full attention (plan refuses longer sequences)
    # Mixture of experts (num_experts 0: every layer has a dense SwiGLU MLP)
    num_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate_size: int = 0  # each expert's intermediate size
    norm_topk_prob: bool = True  # renormalise the top-k routing weights to sum to 1

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelSpec:
        d = dict(d)
        d["rope"] = RopeSpec(**d["rope"])
        d["eos_token_ids"] = tuple(d.get("eos_token_ids") or ())
        return cls(**d)

    def digest(self) -> str:
        """Stable hash of the architecture (not the weights): part of compile-cache keys."""
        blob = json.dumps(self.to_dict(), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def param_count(self, active: bool = False) -> int:
        """Parameters (biases aside); ``active``: counting only the experts a token uses."""
        h, i, d = self.hidden_size, self.intermediate_size, self.head_dim
        attn = h * d * (2 * self.num_heads + 2 * self.num_kv_heads) + (2 * d if self.qk_norm else 0)
        if self.is_moe:
            experts = self.experts_per_token if active else self.num_experts
            mlp = experts * 3 * h * self.moe_intermediate_size + self.num_experts * h  # + router
        else:
            mlp = 3 * h * i
        per_layer = attn + mlp + 2 * h
        emb = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * per_layer + emb + h


def rope_from_config(cfg: dict[str, Any]) -> RopeSpec:
    """Read rope settings in both the transformers<5 (rope_theta + rope_scaling) and the
    transformers>=5 (rope_parameters) spellings."""
    params = dict(cfg.get("rope_parameters") or {})
    scaling = dict(cfg.get("rope_scaling") or {})
    merged = {**scaling, **params}
    theta = float(merged.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    kind = merged.get("rope_type") or merged.get("type") or "default"
    if kind == "default":
        return RopeSpec(theta=theta)
    if kind == "linear":
        return RopeSpec(theta=theta, kind="linear", factor=float(merged["factor"]))
    if kind == "llama3":
        return RopeSpec(
            theta=theta,
            kind="llama3",
            factor=float(merged["factor"]),
            low_freq_factor=float(merged["low_freq_factor"]),
            high_freq_factor=float(merged["high_freq_factor"]),
            original_max_position=int(merged["original_max_position_embeddings"]),
        )
    raise UnsupportedError(
        f"rope scaling type {kind!r} is not supported (supported: default, linear, llama3)"
    )


def sliding_window_from_config(cfg: dict[str, Any]) -> int | None:
    """The attention window that applies to at least one layer, or None (full attention).

    Mistral/Mixtral: ``sliding_window`` (null: none). Qwen2/Qwen3 also need
    ``use_sliding_window`` and slide only layers >= ``max_window_layers``; transformers>=5
    may spell the per-layer choice as ``layer_types``."""
    window = cfg.get("sliding_window")
    if window is None or cfg.get("use_sliding_window") is False:
        return None
    layer_types = cfg.get("layer_types")
    if layer_types is not None:
        return int(window) if "sliding_attention" in layer_types else None
    first = cfg.get("max_window_layers")
    if first is not None and "use_sliding_window" in cfg and int(first) >= int(cfg["num_hidden_layers"]):
        return None
    return int(window)


def eos_ids(cfg: dict[str, Any]) -> tuple[int, ...]:
    eos = cfg.get("eos_token_id")
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list) else (int(eos),)
