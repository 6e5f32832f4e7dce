"""The continuous-batching scheduler (nxdc.serve.engine) against a stand-in model: rows are
independent, so every request must get exactly what it gets alone, whenever it arrives and
whatever runs beside it; admission, prefix reuse, chunking, aborts, stop strings and limits."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from tiny import tiny_tokenizer

from nxdc.buckets import Bucket
from nxdc.runtime.runner import Runner
from nxdc.serve.engine import Engine
from nxdc.serve.protocol import Done, Failed, Started, Submit, Token
from nxdc.serve.text import TextTokenizer

VOCAB = 256  # tiny_tokenizer: <unk> <s> </s> w0..w252
EOS = 2


class FakeRunner:
    """A "model" whose logits at a position depend only on the tokens its row's cache holds at
    positions 0..that one (a hash): what a request gets depends on nothing but its own context,
    and a cache slot the engine forgot to fill, or filled with the wrong token, changes it.
    Records every call."""

    next_chunk = Runner.next_chunk  # the real chunking policy
    check_ids = Runner.check_ids  # and the real refusal of ids outside the vocabulary
    chunk_bucket = Runner.chunk_bucket
    vocab_size = VOCAB

    def __init__(self, batch=4, max_seq=64, chunk=8, eos_bias=0.0, chunks=None):
        self.batch_size, self.max_seq = batch, max_seq
        self.max_chunk = max(chunks or (chunk,))
        self.plan = SimpleNamespace(chunks=[Bucket("chunk", n) for n in (chunks or (chunk,))])
        self.spec = SimpleNamespace(eos_token_ids=(EOS,))
        self.cache = [[None] * max_seq for _ in range(batch)]
        self.calls: list[tuple] = []
        self.eos_bias = eos_bias

    def logits(self, context: list[int]) -> torch.Tensor:
        g = torch.Generator().manual_seed(hash(tuple(context)) % (2**31))
        out = torch.randn(VOCAB, generator=g) * 3
        out[:2] = -1e9  # never <unk> / <s>
        out[EOS] += self.eos_bias
        return out

    def _at(self, row: int, pos: int) -> torch.Tensor:
        ctx = self.cache[row][: pos + 1]
        assert None not in ctx, f"row {row}: slot {ctx.index(None)} read before it was written"
        return self.logits(ctx)

    def prefill_row(self, row: int, ids: list[int], start: int) -> torch.Tensor:
        assert 0 < len(ids) <= self.max_chunk and start + len(ids) <= self.max_seq
        self.check_ids(ids)
        self.calls.append(("prefill", row, len(ids), start))
        self.cache[row][start : start + len(ids)] = ids
        self.cache[row][start + len(ids) :] = [None] * (self.max_seq - start - len(ids))
        return self._at(row, start + len(ids) - 1)

    def decode(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        busy = [r for r in range(self.batch_size) if positions[r] >= 0]
        self.calls.append(("decode", tuple(busy)))
        out = torch.zeros(self.batch_size, VOCAB)
        for r in busy:
            p = int(positions[r])
            self.cache[r][p] = int(tokens[r])
            self.cache[r][p + 1 :] = [None] * (self.max_seq - p - 1)
            out[r] = self._at(r, p)
        return out

    def alone(self, prompt: list[int], max_tokens: int, ignore_eos: bool = False) -> list[int]:
        """Greedy output of one request on its own (the reference)."""
        ctx, out = list(prompt), []
        while len(out) < max_tokens and len(ctx) < self.max_seq:
            t = int(self.logits(ctx).argmax())
            out.append(t)
            if t == EOS and not ignore_eos:
                break
            ctx.append(t)
        return out


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> TextTokenizer:
    d = tmp_path_factory.mktemp("tok")
    tiny_tokenizer().save_pretrained(d)
    return TextTokenizer(d)


def words(tok, ids: list[int]) -> str:
    return tok.decode(ids)


def prompt(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (n,), generator=g).tolist()


def run(engine: Engine, arrivals: dict[int, list[Submit]], max_steps: int = 10_000) -> dict[str, list]:
    """Step until idle; ``arrivals``: step index -> requests submitted before that step.
    Returns every request's events."""
    events: dict[str, list] = {}
    for step in range(max_steps):
        for msg in arrivals.get(step, []):
            engine.submit(msg)
        if not engine.has_work and step > max(arrivals, default=0):
            return events
        if engine.has_work:
            for e in engine.step().events:
                events.setdefault(e.id, []).append(e)
    raise AssertionError("the engine did not finish")


def done(evs: list) -> Done:
    assert isinstance(evs[-1], Done), evs[-1]
    return evs[-1]


def text(evs: list) -> str:
    return "".join(e.text for e in evs if isinstance(e, (Token, Done)))


def test_staggered_greedy_requests_each_get_their_solo_output(tok):
    runner = FakeRunner(batch=4, chunk=8)
    engine = Engine(runner, tok)
    lens = [5, 20, 9, 33, 1, 14, 27, 8, 12, 3]  # more requests than rows: some wait in the queue
    reqs = {i: Submit(f"r{i}", tuple(prompt(i, n)), max_tokens=12) for i, n in enumerate(lens)}
    evs = run(engine, {i * 3: [reqs[i]] for i in range(len(reqs))})
    for msg in reqs.values():
        want = runner.alone(list(msg.prompt_ids), 12)
        d = done(evs[msg.id])
        assert d.completion_tokens == len(want)
        assert text(evs[msg.id]) == tok.decode([t for t in want if t != EOS])
        assert d.prompt_tokens == len(msg.prompt_ids)
        assert d.finish_reason == ("stop" if want[-1] == EOS else "length")
    # prefill never took more than one chunk per step, and never more than 8 tokens
    assert all(c[2] <= 8 for c in runner.calls if c[0] == "prefill")


def test_one_prefill_chunk_per_step_while_rows_decode(tok):
    runner = FakeRunner(batch=4, chunk=8)
    engine = Engine(runner, tok)
    engine.submit(Submit("short", tuple(prompt(1, 4)), max_tokens=40, ignore_eos=True))
    engine.step()  # its prefill
    engine.submit(Submit("long", tuple(prompt(2, 40)), max_tokens=4, ignore_eos=True))
    for _ in range(5):  # 40 prompt tokens: 5 chunks of 8, each beside a decode step of "short"
        runner.calls.clear()
        ev = engine.step()
        assert [c[0] for c in runner.calls] == ["prefill", "decode"]
        assert runner.calls[0][2] == 8 and ev.prefill_tokens == 8 and ev.decode_rows >= 1


@pytest.mark.parametrize(
    "length, limit, pieces",
    [
        (39, 32, [32, 7]),
        (12, 32, [8, 4]),
        (40, 32, [32, 8]),
        (30, 32, [30]),
        (20, 8, [8, 8, 4]),
        (5, 32, [5]),
    ],
)
def test_prompts_are_cut_into_chunks_that_fill_their_graphs(tok, length, limit, pieces):
    runner = FakeRunner(batch=2, chunks=(8, 32))
    engine = Engine(runner, tok, prefill_chunk=limit)
    evs = run(engine, {0: [Submit("p", tuple(prompt(9, length)), max_tokens=3)]})
    assert [c[2] for c in runner.calls if c[0] == "prefill"] == pieces
    assert text(evs["p"]) == tok.decode([t for t in runner.alone(prompt(9, length), 3) if t != EOS])


def test_seeded_sampling_does_not_depend_on_the_batch(tok):
    def sample(with_others: bool) -> str:
        engine = Engine(FakeRunner(batch=4), tok)
        msg = Submit("s", tuple(prompt(7, 6)), max_tokens=20, temperature=0.9, top_p=0.95, seed=1234)
        others = [
            Submit(f"o{i}", tuple(prompt(100 + i, 10)), max_tokens=15, temperature=1.0, seed=i)
            for i in range(3)
        ]
        return text(run(engine, {0: others + [msg] if with_others else [msg]})["s"])

    assert sample(True) == sample(False)
    engine = Engine(FakeRunner(batch=4), tok)
    texts = {
        text(
            run(engine, {0: [Submit(f"x{s}", tuple(prompt(7, 6)), max_tokens=20, temperature=0.9, seed=s)]})[
                f"x{s}"
            ]
        )
        for s in range(4)
    }
    assert len(texts) > 1  # and the seed matters


def test_prefix_reuse_takes_the_row_holding_the_prompt(tok):
    runner = FakeRunner(batch=4, chunk=8)
    engine = Engine(runner, tok)
    base = prompt(3, 20)
    first = run(engine, {0: [Submit("a", tuple(base), max_tokens=5, ignore_eos=True)]})
    row = next(e.row for e in first["a"] if isinstance(e, Started))
    run(engine, {0: [Submit("other", tuple(prompt(4, 6)), max_tokens=3)]})  # takes another (LRU) row
    follow = base[:17] + prompt(5, 6)  # shares 17 tokens with "a"
    runner.calls.clear()
    evs = run(engine, {0: [Submit("b", tuple(follow), max_tokens=8)]})["b"]
    started = next(e for e in evs if isinstance(e, Started))
    assert started.row == row and started.cached_tokens == 17
    assert done(evs).cached_tokens == 17
    assert runner.calls[0] == ("prefill", row, 6, 17)  # only the new tail is computed
    assert text(evs) == tok.decode([t for t in runner.alone(follow, 8) if t != EOS])
    # the same prompt again: all but its last token are reused (the last one's logits start the output)
    evs = run(engine, {0: [Submit("c", tuple(follow), max_tokens=8)]})["c"]
    assert done(evs).cached_tokens == len(follow) - 1
    assert text(evs) == tok.decode([t for t in runner.alone(follow, 8) if t != EOS])


def test_abort_frees_the_row_for_the_next_step(tok):
    runner = FakeRunner(batch=8, chunk=8)
    engine = Engine(runner, tok)
    reqs = [Submit(f"r{i}", tuple(prompt(i, 4)), max_tokens=30, ignore_eos=True) for i in range(8)]
    evs = {}
    for m in reqs:
        engine.submit(m)
    for _ in range(12):  # 8 prefills, then decoding
        for e in engine.step().events:
            evs.setdefault(e.id, []).append(e)
    for i in range(0, 8, 2):
        engine.abort(f"r{i}")
    assert sum(s["state"] != "idle" for s in engine.slot_states()) == 4
    runner.calls.clear()
    step = engine.step()
    assert runner.calls == [("decode", (1, 3, 5, 7))] and step.decode_rows == 4
    for e in step.events:
        evs.setdefault(e.id, []).append(e)
    while engine.has_work:
        for e in engine.step().events:
            evs.setdefault(e.id, []).append(e)
    for i in (1, 3, 5, 7):
        assert done(evs[f"r{i}"]).completion_tokens == 30
        assert text(evs[f"r{i}"]) == tok.decode(runner.alone(list(reqs[i].prompt_ids), 30, ignore_eos=True))
    assert not any(isinstance(e, Done) for i in (0, 2, 4, 6) for e in evs[f"r{i}"])
    engine.abort("r1")  # a finished or unknown request: nothing happens
    engine.abort("nope")


def test_stop_strings_across_tokens_never_leak(tok):
    runner = FakeRunner(batch=2)
    p = prompt(11, 5)
    want = tok.decode([t for t in runner.alone(p, 20, ignore_eos=True)])
    # a stop string that starts inside one word (token) and ends inside the next
    cut = want.index(" ", want.index(" ") + 1)  # the second space
    stop = want[cut - 1 : cut + 3]
    evs = run(
        Engine(runner, tok),
        {0: [Submit("s", tuple(p), max_tokens=20, stop=(stop, "never"), ignore_eos=True)]},
    )
    got = text(evs["s"])
    assert got == want[: want.index(stop)]
    assert done(evs["s"]).finish_reason == "stop"
    assert all(stop[:2] not in e.text for e in evs["s"] if isinstance(e, Token))
    # a stop string that never matches is held back only while it might, and flushed at the end
    evs = run(
        Engine(FakeRunner(batch=2), tok),
        {0: [Submit("t", tuple(p), max_tokens=20, stop=(want[-3:] + "!",), ignore_eos=True)]},
    )
    assert text(evs["t"]) == want and done(evs["t"]).finish_reason == "length"


def test_eos_length_and_cache_limits(tok):
    runner = FakeRunner(batch=2, max_seq=32, eos_bias=4.0)  # EOS comes early
    p = prompt(21, 6)
    solo = runner.alone(p, 20)
    assert solo[-1] == EOS
    d = done(run(Engine(runner, tok), {0: [Submit("e", tuple(p), max_tokens=20)]})["e"])
    assert d.finish_reason == "stop" and d.completion_tokens == len(solo)  # EOS counted, not printed
    d = done(run(Engine(runner, tok), {0: [Submit("i", tuple(p), max_tokens=20, ignore_eos=True)]})["i"])
    assert d.finish_reason == "length" and d.completion_tokens == 20
    d = done(run(Engine(runner, tok), {0: [Submit("m", tuple(p), max_tokens=100, ignore_eos=True)]})["m"])
    assert d.finish_reason == "length" and d.completion_tokens == 32 - 6  # the cache is full


def test_queue_deadline_fails_waiting_requests(tok):
    now = [0.0]
    engine = Engine(FakeRunner(batch=1), tok, clock=lambda: now[0])
    engine.submit(Submit("busy", tuple(prompt(1, 4)), max_tokens=50, ignore_eos=True))
    engine.submit(Submit("late", tuple(prompt(2, 4)), max_tokens=5, queue_deadline=1.0))
    engine.step()
    now[0] = 2.0
    failed = [e for e in engine.step().events if isinstance(e, Failed)]
    assert [(f.id, f.status, f.code) for f in failed] == [("late", 503, "queue_timeout")]
    assert not engine.waiting


def _finish_all(engine: Engine, evs: dict) -> dict:
    while engine.has_work:
        for e in engine.step().events:
            evs.setdefault(e.id, []).append(e)
    return evs


def test_one_bad_request_fails_alone_beside_running_ones(tok):
    """Input the engine refuses (ids outside the vocabulary, sampling values the sampler refuses,
    a duplicate id) and an error while one request is detokenized each fail that request alone:
    its row is freed, and the four requests beside it get exactly their solo output."""
    runner = FakeRunner(batch=5, chunk=8)
    engine = Engine(runner, tok)
    good = [Submit(f"g{i}", tuple(prompt(30 + i, 6 + i)), max_tokens=15, ignore_eos=True) for i in range(4)]
    for m in good:
        engine.submit(m)
    evs: dict = {}
    for _ in range(3):
        for e in engine.step().events:
            evs.setdefault(e.id, []).append(e)
    bad = [
        Submit("vocab", (5, VOCAB + 3), max_tokens=4),
        Submit("negative", (5, -1), max_tokens=4),
        Submit("top_p", (5, 6), max_tokens=4, temperature=0.7, top_p=float("nan")),
        Submit("g0", (5, 6), max_tokens=4),  # an id the engine already has
        Submit("empty", (), max_tokens=4),
    ]
    for m in bad:
        engine.submit(m)
    engine.submit(Submit("detok", tuple(prompt(40, 5)), max_tokens=10, ignore_eos=True))
    engine.seqs["detok"].text.detok.add = lambda *a, **k: 1 / 0  # an error in this request's text alone
    _finish_all(engine, evs)
    for m in bad:
        f = [e for e in evs[m.id] if isinstance(e, Failed)]
        assert len(f) == 1 and f[0].status == 400, evs[m.id]
    assert "outside this model's vocabulary" in evs["vocab"][-1].message
    (fail,) = [e for e in evs["detok"] if isinstance(e, Failed)]
    assert fail.status == 500 and "ZeroDivisionError" in fail.message
    for m in good:
        want = runner.alone(list(m.prompt_ids), 15, ignore_eos=True)
        assert done(evs[m.id]).completion_tokens == 15
        assert text([e for e in evs[m.id] if not isinstance(e, Failed)]) == tok.decode(want)
    assert engine.running == 0 and not engine.seqs and all(s["state"] == "idle" for s in engine.slot_states())


def test_an_error_in_a_graph_call_is_the_engines(tok):
    runner = FakeRunner(batch=2)
    engine = Engine(runner, tok)
    engine.submit(Submit("a", tuple(prompt(1, 4)), max_tokens=5))
    engine.step()

    def broken(*a):
        raise RuntimeError("graph failed")

    runner.decode = broken
    with pytest.raises(RuntimeError, match="graph failed"):
        engine.step()


def test_top_p_zero_is_greedy(tok):
    runner = FakeRunner(batch=2)
    p = prompt(12, 7)
    evs = run(Engine(runner, tok), {0: [Submit("z", tuple(p), max_tokens=12, temperature=0.9, top_p=0.0)]})
    assert text(evs["z"]) == tok.decode([t for t in runner.alone(p, 12) if t != EOS])


def test_aborting_the_last_request_reports_the_free_rows(tok):
    engine = Engine(FakeRunner(batch=2), tok)
    engine.submit(Submit("a", tuple(prompt(1, 4)), max_tokens=50, ignore_eos=True))
    engine.step()
    engine.abort("a")
    assert engine.has_work  # not work to run, but a change to report
    ev = engine.step()
    assert ev.running == 0 and all(s["state"] == "idle" for s in ev.slots)
    assert not engine.has_work


class TimedRunner(FakeRunner):
    """FakeRunner on a fake clock: a chunk graph of n positions takes ``per_token * n`` plus
    ``fixed``, a decode step ``decode_s``."""

    def __init__(self, now: list[float], decode_s=0.02, per_token=0.001, fixed=0.004, **kw):
        super().__init__(**kw)
        self.now, self.decode_s, self.per_token, self.fixed = now, decode_s, per_token, fixed

    def prefill_row(self, row, ids, start):
        graph = self.chunk_bucket(len(ids)).length
        self.now[0] += self.fixed + self.per_token * graph
        return super().prefill_row(row, ids, start)

    def decode(self, tokens, positions):
        self.now[0] += self.decode_s
        return super().decode(tokens, positions)


def test_step_budget_keeps_decoding_rows_within_two_decode_steps(tok):
    now = [0.0]
    # chunk graphs of 8 / 16 / 64 positions take 12 / 20 / 68 ms, a decode step 20 ms
    runner = TimedRunner(now, batch=2, max_seq=256, chunks=(8, 16, 64))
    engine = Engine(runner, tok, prefill_chunk=64, clock=lambda: now[0])
    engine.warm_up()
    assert engine.budget.chunk_s == pytest.approx({8: 0.012, 16: 0.020, 64: 0.068})
    engine.submit(Submit("alone", tuple(prompt(3, 130)), max_tokens=3, ignore_eos=True))
    evs = _finish_all(engine, {})
    first = [c[2] for c in runner.calls if c[0] == "prefill"][3:]  # after the warm-up's 3
    assert first == [64, 64, 2]  # nobody decoding: the whole cap per step
    runner.calls.clear()
    engine.submit(Submit("stream", tuple(prompt(4, 5)), max_tokens=60, ignore_eos=True))
    for e in engine.step().events:
        evs.setdefault(e.id, []).append(e)
    engine.submit(Submit("long", tuple(prompt(5, 100)), max_tokens=3, ignore_eos=True))
    steps = []
    while engine.has_work:
        t0 = now[0]
        for e in engine.step().events:
            evs.setdefault(e.id, []).append(e)
        steps.append(now[0] - t0)
    pieces = [c[2] for c in runner.calls if c[0] == "prefill"][1:]
    assert pieces[:6] == [16] * 6  # the 16-token graph (20 ms) fits one more decode step; 64 would not
    assert max(steps) <= 2 * runner.decode_s + 1e-9
    for rid in ("alone", "stream", "long"):
        msg_prompt = {"alone": prompt(3, 130), "stream": prompt(4, 5), "long": prompt(5, 100)}[rid]
        n = done(evs[rid]).completion_tokens
        assert text(evs[rid]) == tok.decode(runner.alone(msg_prompt, n, ignore_eos=True))


@pytest.mark.parametrize(
    "decode_s, chunk_s, decoding, waiting, want",
    [
        (0.02, {8: 0.012, 32: 0.05}, True, 1, 8),
        (0.02, {8: 0.012, 32: 0.05}, False, 1, 32),
        (0.005, {8: 0.012, 32: 0.05}, True, 1, 8),  # none fits: the smallest, so the prompt advances
        (None, {}, True, 1, 32),  # nothing measured yet: the cap
        (0.05, {8: 0.012, 32: 0.05}, True, 1, 32),
        (0.02, {8: 0.012, 32: 0.05}, True, 2, 8),  # 2 waiting for a first token: 40 ms of room
        (0.02, {8: 0.012, 32: 0.05}, True, 3, 32),  # 3: 60 ms, the 32-token graph fits
        (0.02, {8: 0.012, 32: 0.05}, True, 0, 8),  # never less than one request's room
    ],
)
def test_step_budget_limits(decode_s, chunk_s, decoding, waiting, want):
    from nxdc.serve.engine import StepBudget

    b = StepBudget([8, 32, 128], cap=32)
    if decode_s is not None:
        b.observe_decode(decode_s)
    for n, s in chunk_s.items():
        b.observe_chunk(n, s)
    assert b.limit(decoding, waiting) == want


def test_step_budget_off_takes_the_cap():
    from nxdc.serve.engine import StepBudget

    b = StepBudget([8, 32], cap=32, ratio=0)
    b.observe_decode(0.02)
    b.observe_chunk(8, 0.012)
    b.observe_chunk(32, 0.05)
    assert b.limit(True, 1) == 32
