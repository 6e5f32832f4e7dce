"""Mistral (7B v0.1-v0.3, Nemo, ...): Llama's layout; v0.1's 4096-token sliding window is
read by the shared mapping, and the plan refuses a sequence length beyond it (nxdc attends
over the whole cache, which equals the window's result only up to the window's length)."""

from __future__ import annotations

from nxdc.archs import register
from nxdc.archs.llama import LlamaLike


@register("mistral")
class Mistral(LlamaLike):
    name = "mistral"
