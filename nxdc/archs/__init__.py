"""Architecture registry: ``@register("llama")`` ties a Hugging Face ``model_type`` to the
small per-architecture pieces (config mapping, weight names, GGUF quirks)."""

from __future__ import annotations

from typing import Any, Protocol

from nxdc.errors import UnsupportedError


class Arch(Protocol):
    name: str
    gguf: bool  # whether nxdc can read this architecture's GGUF files

    def spec_from_config(self, cfg: dict[str, Any]) -> Any: ...

    def weight_name(self, hf_name: str) -> str | None: ...


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
