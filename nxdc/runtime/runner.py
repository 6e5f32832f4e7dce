"""The runtime seam that generation, ``nxdc bench`` and ``nxdc serve`` call: a ``Runner`` owns
one loaded export (``Session``), picks the graph for each request (prefill bucket, decode cache
length, how many batch rows a step needs) and runs it.

At tp 1 the graphs run in this process. Under tensor parallelism rank 0 holds a
``workers.GroupRunner``, the same calls, each one announced to the other ranks before it runs
(``workers.py``); ``open_runner`` there returns whichever the export needs.

Batch rows: ``decode`` and ``verify`` take a negative position (start) for an idle row, whose
KV cache is then left untouched. ``prefill_row`` writes one prompt (or one chunk of it) into a
row of its choosing, leaving every other row as it was: with them a server keeps each row busy
with its own request (continuous batching, ``nxdc.serve``)."""

from __future__ import annotations

import torch

from nxdc.buckets import Bucket, pick_context_bucket, pick_decode_bucket
from nxdc.errors import UserInputError
from nxdc.runtime.session import Session


class Runner:
    def __init__(self, session: Session):
        self.session = session
        self.spec, self.plan, self.manifest = session.spec, session.plan, session.manifest
        # exports from before idle rows fed them token 0 at slot 0 (harmless for `generate`)
        self.idle_rows = self.manifest.idle_rows

    @classmethod
    def load(cls, export_dir, threads: int | None = None, verify: bool = True) -> Runner:
        """A tp 1 export in this process (``workers.open_runner`` takes any tp)."""
        return cls(Session(export_dir, threads=threads, verify=verify))

    # --- what the export is -------------------------------------------------------------------
    @property
    def batch_size(self) -> int:
        return self.plan.batch_size

    @property
    def max_seq(self) -> int:
        return self.plan.sequence_length

    @property
    def speculation_length(self) -> int:
        """K of the export's verify graphs (0: the export cannot verify draft tokens)."""
        return self.plan.speculation_length

    @property
    def vocab_size(self) -> int:
        return self.spec.vocab_size

    def check_ids(self, ids) -> None:
        """Refuse token ids outside the vocabulary before they reach a compiled graph (an
        embedding lookup there reads out of bounds or aborts the process). Called where ids come
        from outside the model (prompts, draft tokens); ``decode`` feeds back the model's own
        samples, which are in range, and stays free of the check."""
        t = torch.as_tensor(ids)
        if t.numel() and (int(t.min()) < 0 or int(t.max()) >= self.vocab_size):
            bad = next(int(i) for i in t.flatten().tolist() if not 0 <= i < self.vocab_size)
            raise UserInputError(
                f"token id {bad} is outside this model's vocabulary (0..{self.vocab_size - 1})"
            )

    @property
    def threads(self) -> int:
        return self.session.threads

    @property
    def max_chunk(self) -> int:
        """The longest prompt chunk ``prefill_row`` takes at once (0: the export has no chunk
        graphs and cannot serve)."""
        return max((b.length for b in self.plan.chunks), default=0)

    def chunk_bucket(self, n: int) -> Bucket:
        """The chunk graph that ``prefill_row`` runs ``n`` prompt tokens in: the smallest that holds them."""
        return min((b for b in self.plan.chunks if b.length >= n), key=lambda b: b.length)

    def next_chunk(self, remaining: int, limit: int) -> int:
        """How many of ``remaining`` prompt tokens the next ``prefill_row`` call should take, at
        most ``limit``. A chunk graph costs about its length however few of its positions are
        real, so a piece that would leave most of the smallest graph that holds it empty (> 1/3)
        gives way to the largest graph it fills exactly: 39 tokens with graphs of 32 and 128 go
        as 32 + 7 (64 positions computed), not as 39 in the 128-token graph."""
        lengths = sorted(b.length for b in self.plan.chunks)
        n = min(remaining, limit, lengths[-1])
        holds = min(b for b in lengths if b >= n)
        filled = [b for b in lengths if b <= n]
        if filled and holds > 1.5 * n:
            return filled[-1]
        return n

    # --- graph calls ----------------------------------------------------------------------------
    def call(self, name: str, *inputs: torch.Tensor) -> torch.Tensor:
        return self.session.graphs[name](*inputs)

    def close(self) -> None:
        pass

    def __enter__(self) -> Runner:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def prefill(self, prompts: list[list[int]], pad_id: int = 0) -> torch.Tensor:
        """Fresh prompts into rows 0..n-1 (each at positions 0..len-1) -> logits [batch, vocab]
        at each last token. Every row of the cache is written."""
        if not prompts or len(prompts) > self.batch_size:
            raise UserInputError(f"got {len(prompts)} prompts; this export takes 1 to {self.batch_size}")
        if any(len(p) == 0 for p in prompts):
            raise UserInputError("a prompt encodes to zero tokens")
        for p in prompts:
            self.check_ids(p)
        bucket = pick_context_bucket(self.plan.context, max(len(p) for p in prompts))
        ids = torch.full((self.batch_size, bucket.length), pad_id, dtype=torch.int64)
        last = torch.zeros(self.batch_size, dtype=torch.int64)
        for i, p in enumerate(prompts):
            ids[i, : len(p)] = torch.tensor(p, dtype=torch.int64)
            last[i] = len(p) - 1
        return self.call(bucket.name, ids, last)

    def decode(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """One token per row at its own cache position (negative: an idle row) -> logits
        [batch, vocab] (an idle row's are meaningless). When few rows are busy and the export
        has decode graphs over fewer rows (``--decode-batch-sizes``), only those rows are stepped."""
        busy = (positions >= 0).nonzero().flatten().tolist()
        if not busy:
            raise ValueError("decode: every row is idle")
        bucket = pick_decode_bucket(self.plan.decode, int(positions.max()))
        if not self.idle_rows:
            idle = positions < 0
            tokens, positions = tokens.masked_fill(idle, 0), positions.masked_fill(idle, 0)
        narrow = self._row_decode(len(busy), bucket.length) if self.idle_rows else None
        if narrow is None:
            return self.call(bucket.name, tokens.view(-1, 1), positions)
        # the busy rows first, then idle ones (distinct rows, negative positions) up to its batch
        rows = busy + [r for r in range(self.batch_size) if r not in busy][: narrow.batch - len(busy)]
        idx = torch.tensor(rows, dtype=torch.int64)
        out = self.call(narrow.name, tokens[idx].view(-1, 1), positions[idx], idx)
        logits = out.new_zeros((self.batch_size, out.shape[-1]))
        logits[idx[: len(busy)]] = out[: len(busy)]
        return logits

    def _row_decode(self, busy: int, length: int) -> Bucket | None:
        fits = [b for b in self.plan.row_decode if b.length == length and b.batch >= busy]
        return min(fits, key=lambda b: b.batch) if fits else None

    def verify(self, tokens: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
        """``tokens`` [batch, K+1] at positions start..start+K (start negative: an idle row) ->
        logits [batch, K+1, vocab]."""
        k = self.speculation_length
        self.check_ids(tokens)
        bucket = pick_decode_bucket(self.plan.verify, int(start.max()) + k)
        if not self.idle_rows:
            start = start.clamp(min=0)
        return self.call(bucket.name, tokens, start)

    def prefill_row(self, row: int, ids: list[int], start: int = 0) -> torch.Tensor:
        """Prompt tokens ``ids`` into batch row ``row`` at positions start.. (the row's slots
        below ``start`` must already hold the tokens before them) -> logits [vocab] at the last
        one. At most ``max_chunk`` tokens per call; no other row is touched."""
        n = len(ids)
        if not self.plan.chunks:
            raise UserInputError(
                "this export has no single-row prefill graphs: re-export it with --chunk-buckets"
            )
        if not 0 < n <= self.max_chunk:
            raise ValueError(f"prefill_row: {n} tokens (1..{self.max_chunk} per call)")
        if not 0 <= row < self.batch_size or start < 0 or start + n > self.max_seq:
            raise ValueError(f"prefill_row: row {row}, positions {start}..{start + n - 1} outside the cache")
        self.check_ids(ids)
        bucket = self.chunk_bucket(n)
        x = torch.zeros((1, bucket.length), dtype=torch.int64)
        x[0, :n] = torch.tensor(ids, dtype=torch.int64)
        scalar = lambda v: torch.tensor([v], dtype=torch.int64)  # noqa: E731
        return self.call(bucket.name, x, scalar(row), scalar(start), scalar(n - 1))[0]
