"""Fixed-shape buckets: which graphs an export compiles and which one a request uses."""

from __future__ import annotations

from dataclasses import dataclass

from nxdc.errors import UserInputError


@dataclass(frozen=True)
class Bucket:
    kind: str  # "context" (prefill of up to `length` prompt tokens) | "decode" (attends `length` slots)
    length: int

    @property
    def name(self) -> str:
        return f"{self.kind}-{self.length}"


def context_buckets(max_len: int, min_len: int, explicit: tuple[int, ...] | None) -> list[int]:
    """Powers of two from ``min_len`` up to ``max_len`` (``max_len`` itself always included),
    or an explicit list."""
    if explicit:
        sizes = sorted(set(int(x) for x in explicit))
        if sizes[0] < 1:
            raise UserInputError(f"context buckets must be positive (got {sizes})")
        if sizes[-1] > max_len:
            raise UserInputError(f"context bucket {sizes[-1]} exceeds the max context length {max_len}")
        return sizes
    sizes, n = [], 1
    while n < min(min_len, max_len):
        n *= 2
    while n < max_len:
        sizes.append(n)
        n *= 2
    sizes.append(max_len)
    return sizes


def pick_context_bucket(buckets: list[Bucket], n_tokens: int) -> Bucket:
    """The smallest context bucket that holds ``n_tokens``, or a clear error."""
    fits = [b for b in buckets if b.length >= n_tokens]
    if not fits:
        largest = max(b.length for b in buckets)
        raise UserInputError(
            f"prompt has {n_tokens} tokens but the largest context bucket of this export is {largest}: "
            f"re-export with a larger --max-context-length (and --sequence-length)"
        )
    return min(fits, key=lambda b: b.length)
