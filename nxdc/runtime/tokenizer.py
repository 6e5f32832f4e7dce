"""The tokenizer an export carries (``tokenizer.json`` and its config, written by ``nxdc export``)."""

from __future__ import annotations

from pathlib import Path

from nxdc.errors import UserInputError


def load_tokenizer(export_dir: Path):
    """The export's Hugging Face tokenizer (transformers is imported here, not at start-up)."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(export_dir))
    except Exception as e:
        raise UserInputError(f"{export_dir}: cannot load the tokenizer ({e})") from e
