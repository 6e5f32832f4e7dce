"""Fixed-shape buckets: which graphs an export compiles and which one a request uses."""

from __future__ import annotations

from dataclasses import dataclass

from nxdc.errors import UserInputError

# the kinds whose graphs take a prompt's tokens at once (prefill), not one token per sequence
PROMPT_KINDS = ("context", "chunk")


@dataclass(frozen=True)
class Bucket:
    """One compiled graph's shape. ``context``: a prefill of up to ``length`` prompt tokens per
    sequence; ``decode`` / ``verify``: 1 / K+1 tokens per sequence attending to ``length`` cache
    slots; ``chunk``: up to ``length`` prompt tokens of one sequence into a batch row chosen at
    run time (``nxdc serve``). ``batch``: a decode graph that steps only that many of the
    export's batch rows, named at run time (None: every row)."""

    kind: str
    length: int
    batch: int | None = None

    @property
    def name(self) -> str:
        return f"{self.kind}-{self.length}" + (f"-b{self.batch}" if self.batch else "")


def context_buckets(
    max_len: int, min_len: int, explicit: tuple[int, ...] | None, kind: str = "context"
) -> list[int]:
    """Powers of two from ``min_len`` up to ``max_len`` (``max_len`` itself always included),
    or an explicit list. Used for both prefill lengths and decode cache lengths."""
    if explicit:
        sizes = sorted(set(int(x) for x in explicit))
        if sizes[0] < 1:
            raise UserInputError(f"{kind} buckets must be positive (got {sizes})")
        if sizes[-1] > max_len:
            limit = "max context length" if kind == "context" else "sequence length"
            raise UserInputError(f"{kind} bucket {sizes[-1]} exceeds the {limit} {max_len}")
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


def pick_decode_bucket(buckets: list[Bucket], max_position: int) -> Bucket:
    """The smallest decode graph whose cache slots include ``max_position``."""
    fits = [b for b in buckets if b.length > max_position]
    if not fits:
        raise UserInputError(
            f"position {max_position} is past the sequence length {max(b.length for b in buckets)}"
        )
    return min(fits, key=lambda b: b.length)
