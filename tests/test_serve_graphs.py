"""Graphs for slot-level work (``nxdc serve``): a single-row prefill writes only its own row's
slots, decode steps write nothing for idle rows, and a prompt prefilled in chunks into any row,
while other rows are busy, gives the very logits and greedy tokens of a plain batch prefill."""

from __future__ import annotations

import pytest
import torch

from nxdc.errors import UserInputError
from nxdc.runtime.runner import Runner

pytestmark = pytest.mark.slow


def _caches(runner: Runner) -> dict[str, torch.Tensor]:
    return {n: t for n, t in runner.session.constants.items() if n.endswith("_cache")}


def _written(before: dict, after: dict) -> list[tuple[int, int]]:
    """The (row, slot) pairs whose bytes differ in any cache."""
    out = set()
    for n in before:
        for row, _, slot, _ in (before[n] != after[n]).nonzero().tolist():
            out.add((row, slot))
    return sorted(out)


@pytest.fixture
def runner(tiny_serve_export):
    r = Runner.load(tiny_serve_export)
    torch.manual_seed(0)
    for t in _caches(r).values():  # every row holds something a stray write would change
        t.copy_(torch.randn_like(t))
    return r


def _step(runner: Runner, call) -> list[tuple[int, int]]:
    before = {n: t.clone() for n, t in _caches(runner).items()}
    call()
    return _written(before, _caches(runner))


def test_row_prefill_writes_only_its_rows_slots(runner):
    ids = list(range(10, 23))  # 13 tokens: the chunk-32 graph, 19 of its positions padding
    assert _step(runner, lambda: runner.prefill_row(3, ids, 0)) == [(3, s) for s in range(13)]
    # a chunk at the end of the cache: the chunk-8 graph's 5 padding positions would fall past
    # slot 63; they keep their bytes wherever they are put
    assert _step(runner, lambda: runner.prefill_row(5, ids[:3], 60)) == [(5, 60), (5, 61), (5, 62)]


def test_decode_leaves_idle_rows_untouched(runner):
    tokens = torch.arange(8, dtype=torch.int64) + 20
    pos = torch.full((8,), -1, dtype=torch.int64)
    pos[1], pos[3] = 20, 30  # the graph over all 8 rows
    assert _step(runner, lambda: runner.decode(tokens, pos)) == [(1, 20), (3, 30)]
    pos = torch.full((8,), -1, dtype=torch.int64)
    pos[6] = 41  # one busy row: the graph over 1 row (decode-64-b1)
    assert _step(runner, lambda: runner.decode(tokens, pos)) == [(6, 41)]


def _greedy(runner: Runner, row: int, first: torch.Tensor, start: int, n: int, busy: dict[int, int]):
    """``n`` greedy decode steps of ``row`` from position ``start``; ``busy``: other rows stepped
    alongside (row -> first position), fed arbitrary tokens."""
    tokens, logits, t = [], [], int(first.argmax())
    for i in range(n):
        pos = torch.full((runner.batch_size,), -1, dtype=torch.int64)
        feed = torch.randint(3, 256, (runner.batch_size,))
        pos[row], feed[row] = start + i, t
        for r, p in busy.items():
            pos[r] = p + i
        out = runner.decode(feed, pos)[row].clone()
        tokens.append(t)
        logits.append(out)
        t = int(out.argmax())
    return tokens, logits


def test_chunked_row_prefill_matches_batch_prefill_bit_for_bit(runner):
    torch.manual_seed(1)
    prompt = torch.randint(3, 256, (21,)).tolist()
    ref = runner.prefill([prompt])[0].clone()  # the context graph, row 0; then row 0 alone
    ref_tokens, ref_logits = _greedy(runner, 0, ref, 21, 10, {})
    # row 6, in three chunks (8 + 8 + 5: chunk-8 graphs), with row 2 prefilled and decoding beside it
    runner.prefill_row(2, torch.randint(3, 256, (25,)).tolist(), 0)
    for start in (0, 8):
        runner.prefill_row(6, prompt[start : start + 8], start)
    last = runner.prefill_row(6, prompt[16:], 16)
    assert torch.equal(last, ref)
    tokens, logits = _greedy(runner, 6, last, 21, 10, {2: 25})
    assert tokens == ref_tokens
    assert all(torch.equal(a, b) for a, b in zip(logits, ref_logits, strict=True))


def test_prefix_reuse_continues_from_the_rows_own_slots(runner):
    """A row that holds a prompt's first tokens prefills only the rest (``start > 0``)."""
    torch.manual_seed(2)
    prompt = torch.randint(3, 256, (30,)).tolist()
    whole = runner.prefill_row(1, prompt, 0).clone()
    runner.prefill_row(1, torch.randint(3, 256, (12,)).tolist(), 20)  # a later request's tail
    assert torch.equal(runner.prefill_row(1, prompt[20:], 20), whole)


def test_row_prefill_needs_chunk_graphs(tiny_gqa_export):
    with pytest.raises(UserInputError, match="re-export it with --chunk-buckets"):
        Runner.load(tiny_gqa_export).prefill_row(0, [5, 6], 0)
