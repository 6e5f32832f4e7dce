"""Text in and out of the server without torch: the export's ``tokenizer.json`` through the
``tokenizers`` library, its chat template through jinja2 the way ``transformers`` renders it
(same environment, filters and variables; the token ids match ``nxdc generate --chat``,
tests/test_serve_text.py). Incremental detokenization and stop strings are
``nxdc.generation.text``'s, shared with ``nxdc generate``.

Why not ``transformers.AutoTokenizer``: importing it imports torch (~2 s, ~400 MB), and the HTTP
process of ``nxdc serve`` must stay light and responsive beside the engine process."""

from __future__ import annotations

import json
from datetime import datetime
from functools import cached_property
from pathlib import Path

from nxdc.errors import UserInputError


def _token_text(value) -> str | None:
    """A special token as tokenizer_config.json spells it (a string, or {"content": ...})."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


class TextTokenizer:
    """An export directory's tokenizer: encode prompts, render chat templates, decode ids."""

    def __init__(self, export_dir: str | Path):
        from tokenizers import Tokenizer

        d = Path(export_dir)
        path = d / "tokenizer.json"
        if not path.is_file():
            raise UserInputError(f"{d} has no tokenizer.json: re-run nxdc export")
        try:
            self._tok = Tokenizer.from_file(str(path))
        except Exception as e:
            raise UserInputError(f"{path} does not load ({e})") from e
        cfg_path = d / "tokenizer_config.json"
        self.config = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        template = d / "chat_template.jinja"
        self.chat_template: str | None = (
            template.read_text() if template.is_file() else self.config.get("chat_template")
        )
        if isinstance(self.chat_template, list):  # named templates: the default one
            named = {t.get("name"): t.get("template") for t in self.chat_template}
            self.chat_template = named.get("default")
        self.special = {
            k: t
            for k in ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token")
            if (t := _token_text(self.config.get(k))) is not None
        }
        self.clean_up_spaces = bool(self.config.get("clean_up_tokenization_spaces", False))

    @cached_property
    def max_token_chars(self) -> int:
        """Characters of the vocabulary's longest token (as the tokenizer stores it: at least as
        many as the text it stands for)."""
        return max(map(len, self._tok.get_vocab(with_added_tokens=True)), default=1)

    @property
    def eos_token_id(self) -> int | None:
        eos = self.special.get("eos_token")
        return self._tok.token_to_id(eos) if eos else None

    def encode(self, text: str) -> list[int]:
        """A plain prompt, with the tokenizer's own special tokens (BOS where it adds one)."""
        return self._tok.encode(text, add_special_tokens=True).ids

    def encode_chat(self, messages: list[dict]) -> list[int]:
        """Messages rendered by the chat template (with the generation prompt), then encoded
        without adding special tokens: the template writes them."""
        if not self.chat_template:
            raise UserInputError("this model's tokenizer has no chat template: use /v1/completions")
        import jinja2

        try:
            text = self._template.render(messages=messages, add_generation_prompt=True, **self.special)
        except jinja2.TemplateError as e:
            raise UserInputError(f"the chat template refused the messages: {e}") from e
        return self._tok.encode(text, add_special_tokens=False).ids

    @cached_property
    def _template(self):
        import jinja2
        import jinja2.ext
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise jinja2.exceptions.TemplateError(message)

        def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
            return json.dumps(
                x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
            )

        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
        )
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        return env.from_string(self.chat_template)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids`` (called like transformers' ``decode``: ``nxdc.generation.text``
        detokenizes with either)."""
        text = self._tok.decode(ids, skip_special_tokens=skip_special_tokens)
        return _clean_up(text) if self.clean_up_spaces else text


def _clean_up(text: str) -> str:
    """transformers' clean_up_tokenization (for tokenizers that ask for it)."""
    for a, b in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't")):
        text = text.replace(a, b)
    for a, b in ((" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
        text = text.replace(a, b)
    return text
