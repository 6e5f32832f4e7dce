"""Stop conditions: EOS tokens and stop strings (matched in decoded text)."""

from __future__ import annotations


def find_stop(text: str, stops: list[str], start: int = 0) -> int | None:
    """Index where the earliest stop string begins in ``text[start:]`` (absolute), or None."""
    hits = [i for s in stops if s and (i := text.find(s, max(0, start))) >= 0]
    return min(hits) if hits else None
