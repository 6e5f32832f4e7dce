"""Architecture registry: ``@register("llama")`` ties a Hugging Face ``model_type`` to the
small per-architecture pieces: config mapping, and checkpoint names (HF and GGUF) onto the
model's. How each weight shards is the model's business (its layers declare it), so adding an
architecture is one file here plus, only where its math differs, a layer."""

from __future__ import annotations

from typing import Any, Protocol

from nxdc.errors import UnsupportedError, UserInputError
from nxdc.spec import ModelSpec


class Arch(Protocol):
    name: str
    gguf: bool  # whether nxdc can read this architecture's GGUF files

    def spec_from_config(self, cfg: dict[str, Any]) -> Any: ...

    def weight_name(self, hf_name: str) -> str | None: ...  # HF checkpoint name -> the model's

    def hf_name(self, name: str) -> str: ...  # the model's name -> HF checkpoint name

    def gguf_name(self, gguf_name: str) -> str | None: ...  # GGUF tensor name -> HF checkpoint name

    def gguf_permuted(self, hf_name: str) -> bool: ...  # llama.cpp permuted its rows per head


_REGISTRY: dict[str, Any] = {}


def register(model_type: str):
    def deco(cls):
        _REGISTRY[model_type] = cls()
        return cls

    return deco


def supported() -> list[str]:
    _load_all()
    return sorted(_REGISTRY)


def get_arch(model_type: str):
    _load_all()
    try:
        return _REGISTRY[model_type]
    except KeyError:
        raise UnsupportedError(
            f"unsupported architecture {model_type!r}; supported: {', '.join(supported())}"
        ) from None


def _load_all() -> None:
    from nxdc.archs import llama, mistral, mixtral, qwen2, qwen3, qwen3_moe  # noqa: F401


def spec_from_config(cfg: dict[str, Any]) -> ModelSpec:
    """Map a Hugging Face config dict to a ModelSpec through the architecture registry."""
    model_type = cfg.get("model_type")
    if not model_type:
        raise UserInputError("config.json has no 'model_type': is this a Hugging Face model?")
    arch = get_arch(model_type)
    try:
        return arch.spec_from_config(cfg)
    except KeyError as e:
        raise UserInputError(f"config.json ({model_type}) has no {e.args[0]!r}") from None
    except (TypeError, ValueError) as e:
        raise UserInputError(f"config.json ({model_type}) has an invalid value: {e}") from None
