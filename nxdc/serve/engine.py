"""Continuous batching over an export's batch rows: the scheduler of ``nxdc serve``.

Every batch row of the export is a slot with its own KV cache. A request waits in a FIFO queue
until a row is free; it then takes the free row whose cache already holds the longest prefix of
its prompt (reused, not recomputed: ``cached_tokens``), else the least recently used one. Each
``step``:

1. requests past their queue deadline fail (503), waiting requests are admitted to free rows;
2. at most one prefill chunk runs (``Runner.prefill_row``: prompt tokens of the oldest admitted
   request into its row). Its length is the step's token budget (``StepBudget``): while rows
   are decoding, the largest chunk graph whose measured time keeps the step within
   ``STEP_RATIO`` decode steps (more when several requests wait for their first token), so a
   stream waits a bounded time for its next token however long an arriving prompt is; with no
   row decoding, ``prefill_chunk`` (nobody waits);
3. one decode step runs over every row whose prompt is in, the idle rows untouched;
4. each row samples with its own request's parameters and seed (a row's logits do not depend on
   the other rows, so neither do its tokens) and emits; its ``TextStream``
   (``nxdc.generation.text``, as in ``nxdc generate``) detokenizes incrementally and decides the
   end: EOS, stop strings (across token boundaries), ``max_tokens`` and the cache length.

Aborted requests (a client gone) free their row before the next step. A failure that belongs to
one request (a token id outside the vocabulary, sampling parameters the sampler refuses, an
error while detokenizing or matching its stop strings) fails that request alone (``Failed``) and
frees its row; only an error in a graph call is the engine's (it propagates: ``Fatal``). The
runner is any ``nxdc.runtime.runner.Runner``: tp 1 or a tensor-parallel group."""

from __future__ import annotations

import time
from collections import deque

import torch

from nxdc.errors import UserInputError
from nxdc.generation.sampling import Sampler, SamplingParams
from nxdc.generation.text import TextStream, eos_ids
from nxdc.serve.protocol import Done, Events, Failed, Started, Submit, Token
from nxdc.serve.text import TextTokenizer


class Seq:
    """One request's state while it waits or runs."""

    def __init__(self, msg: Submit, tokenizer: TextTokenizer, now: float, eos: set[int], max_seq: int):
        self.msg, self.id = msg, msg.id
        self.prompt = list(msg.prompt_ids)
        greedy = msg.temperature <= 0 or msg.top_p <= 0  # top_p -> 0 keeps the likeliest token alone
        self.sampler = Sampler(
            SamplingParams(
                do_sample=not greedy,
                temperature=1.0 if greedy else msg.temperature,
                top_k=msg.top_k,
                top_p=msg.top_p if not greedy else 1.0,
                seed=msg.seed,
            )
        )
        self.text = TextStream(  # decides when the request ends: EOS, stop strings, lengths
            tokenizer,
            max_new_tokens=msg.max_tokens,
            eos=set() if msg.ignore_eos else eos,
            stops=msg.stop,
            room=max_seq - len(self.prompt),
        )
        self.out: list[int] = []  # sampled tokens (the last one not yet in the cache)
        self.fed = 0  # prompt tokens in the row's cache
        self.cached = 0  # of those, reused from the row's previous request
        self.arrival = now
        self.slot: Slot | None = None

    @property
    def prefilling(self) -> bool:
        return self.fed < len(self.prompt)


class Slot:
    """One batch row: the tokens whose keys / values its cache holds (positions 0..), kept after
    a request ends for the next one to reuse."""

    def __init__(self, index: int):
        self.index = index
        self.held: list[int] = []
        self.seq: Seq | None = None
        self.last_used = 0

    def state(self) -> dict:
        s = self.seq
        return {
            "row": self.index,
            "state": "idle" if s is None else ("prefilling" if s.prefilling else "decoding"),
            "request": s.id if s else None,
            "prompt_tokens": len(s.prompt) if s else None,
            "cached_tokens": s.cached if s else None,
            "generated_tokens": len(s.out) if s else None,
            "held_tokens": len(self.held),
        }


def shared_prefix(a: list[int], b: list[int], limit: int) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if n >= limit or x != y:
            break
        n += 1
    return n


DEFAULT_CHUNK = 128
STEP_RATIO = 2.0  # while rows decode, a step (decode + prefill chunk) takes at most ~2 decode steps


def default_chunk(runner) -> int:
    """``--prefill-chunk``'s default: the largest chunk graph up to 128 tokens (else the
    smallest). A chunk's prompt tokens cost about as much per token whatever the chunk length
    (compute-bound), so a longer chunk does not prefill faster; it only makes the rows that are
    decoding wait longer for their next token (SmolLM2 on 2 cores: ~160 ms for 128 tokens)."""
    lengths = sorted(b.length for b in runner.plan.chunks)
    return max((n for n in lengths if n <= DEFAULT_CHUNK), default=lengths[0])


class StepBudget:
    """Prompt tokens one engine step may prefill, from the measured times of the graphs.

    With no row decoding, ``cap`` (``--prefill-chunk``): nobody waits, the prompt goes in as fast
    as the graphs allow. With rows decoding, each of them waits for the step's prefill chunk
    before its next token, while the requests that wait for their first token (prefilling or
    queued) wait for the prompts ahead of them: the chunk is the largest chunk graph (up to
    ``cap``) whose measured time is within ``ratio - 1`` decode steps per request waiting for its
    first token. One long prompt arriving beside running streams then goes in small chunks (a
    step takes at most ``ratio`` decode steps); a backlog of prompts gets longer chunks, which
    cost less per token (every graph call reads all the weights once), so neither side starves.
    If even the smallest graph takes longer, the smallest (a prompt always advances). Until a
    graph has been timed (``warm_up`` times them all at start), it is not chosen; with nothing
    timed, ``cap``; ``ratio`` 0: no budget, ``cap`` always. Times are moving averages of the
    engine's own calls."""

    ALPHA = 0.25  # weight of the newest time in the moving average

    def __init__(self, lengths: list[int], cap: int, ratio: float = STEP_RATIO):
        self.cap, self.ratio = cap, ratio
        self.lengths = sorted(n for n in set(lengths) if n <= cap) or [min(lengths)]
        self.decode_s: float | None = None
        self.chunk_s: dict[int, float] = {}

    def _avg(self, old: float | None, new: float) -> float:
        return new if old is None else old + self.ALPHA * (new - old)

    def observe_decode(self, seconds: float) -> None:
        self.decode_s = self._avg(self.decode_s, seconds)

    def observe_chunk(self, graph_length: int, seconds: float) -> None:
        self.chunk_s[graph_length] = self._avg(self.chunk_s.get(graph_length), seconds)

    def limit(self, decoding: bool, first_token_waiting: int = 1) -> int:
        if not decoding or self.ratio <= 0 or self.decode_s is None or not self.chunk_s:
            return self.cap
        room = (self.ratio - 1) * self.decode_s * max(1, first_token_waiting)
        fits = [n for n in self.lengths if self.chunk_s.get(n, float("inf")) <= room]
        return max(fits) if fits else self.lengths[0]


class Engine:
    def __init__(
        self,
        runner,
        tokenizer: TextTokenizer,
        prefill_chunk: int | None = None,
        step_budget: float | None = None,
        clock=time.monotonic,
    ):
        if runner.max_chunk < 1:
            raise ValueError("the export has no single-row prefill graphs")
        self.runner, self.tokenizer, self.clock = runner, tokenizer, clock
        self.chunk = min(prefill_chunk or default_chunk(runner), runner.max_chunk)
        ratio = STEP_RATIO if step_budget is None else step_budget
        self.budget = StepBudget([b.length for b in runner.plan.chunks], self.chunk, ratio)
        self.slots = [Slot(i) for i in range(runner.batch_size)]
        self.waiting: deque[Seq] = deque()
        self.prefilling: deque[Seq] = deque()  # admitted, prompt not all in yet: oldest first
        self.seqs: dict[str, Seq] = {}
        self.eos = eos_ids(runner.spec.eos_token_ids, tokenizer)
        self._tick = 0
        self._early: list = []  # events of requests refused on submit, sent with the next step
        self._changed = False  # rows freed by an abort: the next step reports them

    # --- requests in and out ----------------------------------------------------------------
    def submit(self, msg: Submit) -> None:
        """Queue a request; one the engine cannot run fails alone (``Failed`` in the next step)."""
        try:
            if msg.id in self.seqs:
                raise UserInputError(f"request {msg.id} is already in the engine")
            if not msg.prompt_ids or len(msg.prompt_ids) >= self.runner.max_seq:
                raise UserInputError(
                    f"{len(msg.prompt_ids)} prompt tokens: this export takes 1 to {self.runner.max_seq - 1}"
                )
            self.runner.check_ids(list(msg.prompt_ids))
            seq = Seq(msg, self.tokenizer, self.clock(), self.eos, self.runner.max_seq)
        except Exception as e:
            self._early.append(_failure(msg.id, e))
            return
        self.seqs[msg.id] = seq
        self.waiting.append(seq)

    def abort(self, request_id: str) -> None:
        """Drop a request (its client went away); its row is free for the next step."""
        seq = self.seqs.pop(request_id, None)
        if seq is None:
            return
        if seq.slot is None:
            self.waiting.remove(seq)
        else:
            self._release(seq)
        self._changed = True

    @property
    def has_work(self) -> bool:
        """Something for ``step`` to do or to report."""
        return bool(self.waiting or self._early or self._changed) or self.running > 0

    @property
    def running(self) -> int:
        return sum(s.seq is not None for s in self.slots)

    def slot_states(self) -> list[dict]:
        return [s.state() for s in self.slots]

    def warm_up(self) -> None:
        """Run each chunk graph the budget may pick and a decode step once, on row 0 (no request
        holds it yet), so the budget starts from measured times and no request pays a first
        call."""
        if self.running or self.waiting:
            raise RuntimeError("warm_up runs before any request")
        for n in self.budget.lengths:
            t0 = self.clock()
            self.runner.prefill_row(0, [0] * n, 0)
            self.budget.observe_chunk(n, self.clock() - t0)
        tokens = torch.zeros(self.runner.batch_size, dtype=torch.int64)
        positions = torch.full((self.runner.batch_size,), -1, dtype=torch.int64)
        positions[0] = 0
        for _ in range(2):  # the first call also pages in what the chunk graphs did not touch
            t0 = self.clock()
            self.runner.decode(tokens, positions)
            self.budget.observe_decode(self.clock() - t0)

    # --- one iteration ------------------------------------------------------------------------
    def step(self) -> Events:
        t0 = self.clock()
        ev = Events(events=self._early)
        self._early, self._changed = [], False
        self._expire(ev, t0)
        self._admit(ev, t0)
        ev.prefill_tokens = self._prefill(ev)
        ev.decode_rows = self._decode(ev)
        ev.step_s = self.clock() - t0
        ev.running, ev.waiting = self.running, len(self.waiting)
        ev.slots = self.slot_states()
        return ev

    def _expire(self, ev: Events, now: float) -> None:
        for seq in [
            s for s in self.waiting if s.msg.queue_deadline is not None and now > s.msg.queue_deadline
        ]:
            self.waiting.remove(seq)
            del self.seqs[seq.id]
            ev.events.append(
                Failed(seq.id, 503, "queue_timeout", "no batch row became free in time (--queue-timeout)")
            )

    def _admit(self, ev: Events, now: float) -> None:
        free = [s for s in self.slots if s.seq is None]
        while self.waiting and free:
            seq = self.waiting.popleft()
            limit = len(seq.prompt) - 1  # at least one token is prefilled: its logits start the output
            slot = max(free, key=lambda s: (shared_prefix(s.held, seq.prompt, limit), -s.last_used))
            free.remove(slot)
            reuse = shared_prefix(slot.held, seq.prompt, limit)
            del slot.held[reuse:]
            slot.seq, seq.slot = seq, slot
            seq.fed = seq.cached = reuse
            self.prefilling.append(seq)
            ev.events.append(Started(seq.id, slot.index, reuse, now - seq.arrival))

    def _prefill(self, ev: Events) -> int:
        if not self.prefilling:
            return 0
        seq = self.prefilling[0]
        decoding = any(s.seq is not None and not s.seq.prefilling for s in self.slots)
        limit = self.budget.limit(decoding, len(self.prefilling) + len(self.waiting))
        n = self.runner.next_chunk(len(seq.prompt) - seq.fed, limit)
        chunk = seq.prompt[seq.fed : seq.fed + n]
        t0 = self.clock()
        try:
            logits = self.runner.prefill_row(seq.slot.index, chunk, seq.fed)
        except UserInputError as e:  # refused before the graph ran: this request's input
            self._fail(seq, e, ev)
            return 0
        self.budget.observe_chunk(self.runner.chunk_bucket(n).length, self.clock() - t0)
        seq.slot.held.extend(chunk)
        seq.fed += len(chunk)
        if not seq.prefilling:
            self.prefilling.popleft()
            self._sample(seq, logits, ev)
        return len(chunk)

    def _decode(self, ev: Events) -> int:
        rows = [s for s in self.slots if s.seq is not None and not s.seq.prefilling]
        if not rows:
            return 0
        b = self.runner.batch_size
        tokens = torch.zeros(b, dtype=torch.int64)
        positions = torch.full((b,), -1, dtype=torch.int64)
        for s in rows:
            tokens[s.index], positions[s.index] = s.seq.out[-1], len(s.held)
        t0 = self.clock()
        logits = self.runner.decode(tokens, positions)
        self.budget.observe_decode(self.clock() - t0)
        for s in rows:
            seq = s.seq
            s.held.append(seq.out[-1])
            self._sample(seq, logits[s.index], ev)
        return len(rows)

    def _sample(self, seq: Seq, logits: torch.Tensor, ev: Events) -> None:
        """Sample the request's next token and emit it; an error here is this request's alone."""
        try:
            self._push(seq, int(seq.sampler(logits.view(1, -1))[0]), ev)
        except Exception as e:
            self._fail(seq, e, ev)

    def _push(self, seq: Seq, token: int, ev: Events) -> None:
        """Append a sampled token (an EOS one too: it is counted, not printed); emit its text, and
        finish the request if its ``TextStream`` says it is done."""
        seq.out.append(token)
        piece = seq.text.push(token)
        if piece.text is not None:
            ev.events.append(Token(seq.id, piece.text))
        if seq.text.finished:
            n = len(seq.prompt)
            ev.events.append(Done(seq.id, seq.text.finish_reason, piece.rest, n, len(seq.out), seq.cached))
            self.seqs.pop(seq.id, None)
            self._release(seq)

    def _fail(self, seq: Seq, error: Exception, ev: Events) -> None:
        """End one request with an error and free its row (whose cache is not reused)."""
        ev.events.append(_failure(seq.id, error))
        self.seqs.pop(seq.id, None)
        if seq.slot is not None:
            seq.slot.held.clear()
            self._release(seq)

    def _release(self, seq: Seq) -> None:
        slot = seq.slot
        if seq in self.prefilling:
            self.prefilling.remove(seq)
        slot.seq, seq.slot = None, None
        self._tick += 1
        slot.last_used = self._tick


def _failure(request_id: str, error: Exception) -> Failed:
    """A request's own error: 400 for input the engine refuses, 500 for anything else."""
    if isinstance(error, UserInputError):
        return Failed(request_id, 400, "invalid_request", str(error))
    return Failed(request_id, 500, "internal_error", f"{type(error).__name__}: {error}")
