"""ModelSpec: the architecture facts nxdc needs, mapped from a Hugging Face config."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

from nxdc.errors import UnsupportedError, UserInputError


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
    attention_bias: bool = False
    mlp_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)

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

    def param_count(self) -> int:
        h, i, d = self.hidden_size, self.intermediate_size, self.head_dim
        attn = h * d * (2 * self.num_heads + 2 * self.num_kv_heads)
        per_layer = attn + 3 * h * i + 2 * h
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


def eos_ids(cfg: dict[str, Any]) -> tuple[int, ...]:
    eos = cfg.get("eos_token_id")
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list) else (int(eos),)


def spec_from_config(cfg: dict[str, Any]) -> ModelSpec:
    """Map a Hugging Face config dict to a ModelSpec through the architecture registry."""
    from nxdc.archs import get_arch

    model_type = cfg.get("model_type")
    if not model_type:
        raise UserInputError("config.json has no 'model_type': is this a Hugging Face model?")
    return get_arch(model_type).spec_from_config(cfg)
