"""One sequence's output text, a token at a time: the text layer of ``nxdc generate`` / ``nxdc
bench`` (``nxdc.generation.loop``) and ``nxdc serve`` (``nxdc.serve.engine``) alike. Incremental
detokenization, stop strings matched across token boundaries (a possible partial match held back,
never sent), and when a sequence ends and why are decided here and only here (``TextStream``).

Finish reasons are OpenAI's, with the cause kept beside them:

- ``stop``: ``eos`` (an end-of-sequence token; it has no text) or ``stop_string`` (the text is cut
  where the stop string begins);
- ``length``: ``max_new_tokens`` (the sequence's token budget) or ``max_seq`` (the KV cache is
  full: prompt + new tokens reach the export's sequence length).

No torch: the tokenizer is anything whose ``decode(ids, skip_special_tokens=True)`` gives the text
(transformers' tokenizers, ``nxdc.serve.text.TextTokenizer``)."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import NamedTuple

FINISH_REASONS = {"eos": "stop", "stop_string": "stop", "max_new_tokens": "length", "max_seq": "length"}


def eos_ids(model_eos: Collection[int], tokenizer) -> set[int]:
    """The token ids that end a sequence: the model config's and the tokenizer's EOS."""
    ids = {int(t) for t in model_eos}
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return ids


def find_stop(text: str, stops: Sequence[str], start: int = 0) -> int | None:
    """Index where the earliest stop string begins in ``text[start:]`` (absolute), or None."""
    hits = [i for s in stops if s and (i := text.find(s, max(0, start))) >= 0]
    return min(hits) if hits else None


class Detokenizer:
    """Text of a growing list of token ids, a piece at a time: each ``add`` returns the text
    the new token completes. Decodes a short window (from the token before the last emitted
    text) so a step costs the same however long the output is, and a character split over
    several tokens (bytes of UTF-8) is returned once it is whole."""

    def __init__(self, tokenizer):
        self.tok = tokenizer
        self.ids: list[int] = []
        self.prefix = 0  # window start: the text of ids[prefix:read] was emitted already
        self.read = 0

    def _decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)

    def add(self, token: int, decode: bool = True) -> str:
        """The text ``token`` completes (``decode`` False: none yet, it all comes with ``flush``)."""
        self.ids.append(token)
        if not decode:
            return ""
        before = self._decode(self.ids[self.prefix : self.read])
        now = self._decode(self.ids[self.prefix :])
        if len(now) > len(before) and not now.endswith("\ufffd"):
            self.prefix, self.read = self.read, len(self.ids)
            return now[len(before) :]
        return ""

    def flush(self) -> str:
        """What is left at the end (an incomplete character as U+FFFD)."""
        before = self._decode(self.ids[self.prefix : self.read])
        now = self._decode(self.ids[self.prefix :])
        self.prefix = self.read = len(self.ids)
        return now[len(before) :] if len(now) > len(before) else ""


class StopStrings:
    """Holds back text that may be the start of a stop string, so that no part of one is ever
    sent; ``feed`` returns the text that is now safe and whether a stop string was completed
    (the text is then cut where it begins)."""

    def __init__(self, stops: Sequence[str]):
        self.stops = [s for s in stops if s]
        self.pending = ""

    def feed(self, text: str) -> tuple[str, bool]:
        if not self.stops:
            return text, False
        text = self.pending + text
        cut = find_stop(text, self.stops)
        if cut is not None:
            self.pending = ""
            return text[:cut], True
        hold = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(text)), hold, -1):
                if text.endswith(s[:k]):
                    hold = k
                    break
        self.pending = text[len(text) - hold :]
        return text[: len(text) - hold], False

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


class Piece(NamedTuple):
    """What one token adds to the output."""

    text: str | None  # the text it completes, safe to send now (None: an EOS token, no text)
    rest: str  # once the sequence has finished, the text held back until then ("" before)


class TextStream:
    """One sequence's output: ``push`` takes each new token and returns the text to send; once
    the sequence is done, ``finished`` is true, with ``finish_reason`` (stop | length) and
    ``cause`` (eos | stop_string | max_new_tokens | max_seq).

    ``eos``: the token ids that end the sequence (empty: none does); ``room``: how many new
    tokens the KV cache has room for (sequence length - prompt tokens; None: no limit). With
    ``live`` false and no stop strings, tokens are not decoded one by one: the whole text comes
    at the end (``Piece.rest``), as one decode."""

    def __init__(
        self,
        tokenizer,
        *,
        max_new_tokens: int,
        eos: Collection[int] = (),
        stops: Sequence[str] = (),
        room: int | None = None,
        live: bool = True,
    ):
        self.detok = Detokenizer(tokenizer)
        self.stops = StopStrings(stops)
        self.eos, self.max_new, self.room = eos, max_new_tokens, room
        self.live = live or bool(self.stops.stops)
        self.tokens = 0  # tokens pushed, an ending EOS included
        self.cause: str | None = None

    @property
    def finished(self) -> bool:
        return self.cause is not None

    @property
    def finish_reason(self) -> str | None:
        return FINISH_REASONS.get(self.cause)

    def push(self, token: int) -> Piece:
        if self.finished:
            raise RuntimeError(f"the sequence has finished ({self.cause}): no more tokens")
        self.tokens += 1
        if token in self.eos:
            return Piece(None, self._end("eos"))
        text, stopped = self.stops.feed(self.detok.add(token, decode=self.live))
        if stopped:
            self.cause = "stop_string"
            return Piece(text, "")
        if self.tokens >= self.max_new:
            return Piece(text, self._end("max_new_tokens"))
        if self.room is not None and self.tokens >= self.room:
            return Piece(text, self._end("max_seq"))
        return Piece(text, "")

    def _end(self, cause: str) -> str:
        """Finish; release what was held back (a last character, a possible stop string, which
        may complete a stop string after all)."""
        rest, stopped = self.stops.feed(self.detok.flush())
        self.cause = "stop_string" if stopped else cause
        return rest if stopped else rest + self.stops.flush()
