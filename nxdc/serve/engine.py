"""Continuous batching over an export's batch rows: the scheduler of ``nxdc serve``.

Every batch row of the export is a slot with its own KV cache. A request waits in a FIFO queue
until a row is free; it then takes the free row whose cache already holds the longest prefix of
its prompt (reused, not recomputed: ``cached_tokens``), else the least recently used one. Each
``step``:

1. requests past their queue deadline fail (503), waiting requests are admitted to free rows;
2. at most one prefill chunk runs (``Runner.prefill_row``: up to ``prefill_chunk`` prompt tokens
   of the oldest admitted request into its row), so the rows already decoding wait at most one
   chunk for their next token however long an arriving prompt is;
3. one decode step runs over every row whose prompt is in, the idle rows untouched;
4. each row samples with its own request's parameters and seed (a row's logits do not depend on
   the other rows, so neither do its tokens), detokenizes incrementally, checks EOS, stop
   strings (across token boundaries), ``max_tokens`` and the cache length, and emits.

Aborted requests (a client gone) free their row before the next step. The runner is any
``nxdc.runtime.runner.Runner``: tp 1 or a tensor-parallel group."""

from __future__ import annotations

import time
from collections import deque

import torch

from nxdc.generation.sampling import Sampler, SamplingParams
from nxdc.serve.protocol import Done, Events, Failed, Started, Submit, Token
from nxdc.serve.text import Detokenizer, StopStrings, TextTokenizer


class Seq:
    """One request's state while it waits or runs."""

    def __init__(self, msg: Submit, tokenizer: TextTokenizer, now: float):
        self.msg, self.id = msg, msg.id
        self.prompt = list(msg.prompt_ids)
        greedy = msg.temperature <= 0
        self.sampler = Sampler(
            SamplingParams(
                do_sample=not greedy,
                temperature=1.0 if greedy else msg.temperature,
                top_k=msg.top_k,
                top_p=msg.top_p,
                seed=msg.seed,
            )
        )
        self.detok = Detokenizer(tokenizer)
        self.stops = StopStrings(list(msg.stop))
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


def default_chunk(runner) -> int:
    """``--prefill-chunk``'s default: the largest chunk graph up to 128 tokens (else the
    smallest). A chunk's prompt tokens cost about as much per token whatever the chunk length
    (compute-bound), so a longer chunk does not prefill faster; it only makes the rows that are
    decoding wait longer for their next token (SmolLM2 on 2 cores: ~160 ms for 128 tokens)."""
    lengths = sorted(b.length for b in runner.plan.chunks)
    return max((n for n in lengths if n <= DEFAULT_CHUNK), default=lengths[0])


class Engine:
    def __init__(
        self,
        runner,
        tokenizer: TextTokenizer,
        prefill_chunk: int | None = None,
        clock=time.monotonic,
    ):
        if runner.max_chunk < 1:
            raise ValueError("the export has no single-row prefill graphs")
        self.runner, self.tokenizer, self.clock = runner, tokenizer, clock
        self.chunk = min(prefill_chunk or default_chunk(runner), runner.max_chunk)
        self.slots = [Slot(i) for i in range(runner.batch_size)]
        self.waiting: deque[Seq] = deque()
        self.prefilling: deque[Seq] = deque()  # admitted, prompt not all in yet: oldest first
        self.seqs: dict[str, Seq] = {}
        self.eos = set(runner.spec.eos_token_ids)
        if tokenizer.eos_token_id is not None:
            self.eos.add(tokenizer.eos_token_id)
        self._tick = 0

    # --- requests in and out ----------------------------------------------------------------
    def submit(self, msg: Submit) -> None:
        if msg.id in self.seqs:
            raise ValueError(f"request {msg.id} is already in the engine")
        if not msg.prompt_ids or len(msg.prompt_ids) >= self.runner.max_seq:
            raise ValueError(f"request {msg.id}: {len(msg.prompt_ids)} prompt tokens")
        seq = Seq(msg, self.tokenizer, self.clock())
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

    @property
    def has_work(self) -> bool:
        return bool(self.waiting) or any(s.seq is not None for s in self.slots)

    @property
    def running(self) -> int:
        return sum(s.seq is not None for s in self.slots)

    def slot_states(self) -> list[dict]:
        return [s.state() for s in self.slots]

    # --- one iteration ------------------------------------------------------------------------
    def step(self) -> Events:
        t0 = self.clock()
        ev = Events()
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
        n = self.runner.next_chunk(len(seq.prompt) - seq.fed, self.chunk)
        chunk = seq.prompt[seq.fed : seq.fed + n]
        logits = self.runner.prefill_row(seq.slot.index, chunk, seq.fed)
        seq.slot.held.extend(chunk)
        seq.fed += len(chunk)
        if not seq.prefilling:
            self.prefilling.popleft()
            self._push(seq, int(seq.sampler(logits.view(1, -1))[0]), ev)
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
        logits = self.runner.decode(tokens, positions)
        for s in rows:
            seq = s.seq
            s.held.append(seq.out[-1])
            self._push(seq, int(seq.sampler(logits[s.index].view(1, -1))[0]), ev)
        return len(rows)

    def _push(self, seq: Seq, token: int, ev: Events) -> None:
        """Append a sampled token; emit its text, and finish the request if it is done."""
        seq.out.append(token)
        if token in self.eos and not seq.msg.ignore_eos:
            return self._finish(seq, "stop", ev)
        text, stopped = seq.stops.feed(seq.detok.add(token))
        ev.events.append(Token(seq.id, text))
        if stopped:
            return self._finish(seq, "stop", ev, rest="")
        if len(seq.out) >= seq.msg.max_tokens or len(seq.prompt) + len(seq.out) >= self.runner.max_seq:
            return self._finish(seq, "length", ev)

    def _finish(self, seq: Seq, reason: str, ev: Events, rest: str | None = None) -> None:
        if rest is None:  # release what was held back: a last character, a possible stop string
            rest, stopped = seq.stops.feed(seq.detok.flush())
            reason = "stop" if stopped else reason
            rest += "" if stopped else seq.stops.flush()
        n = len(seq.prompt)
        ev.events.append(Done(seq.id, reason, rest, n, len(seq.out), seq.cached))
        self.seqs.pop(seq.id, None)
        self._release(seq)

    def _release(self, seq: Seq) -> None:
        slot = seq.slot
        if seq in self.prefilling:
            self.prefilling.remove(seq)
        slot.seq, seq.slot = None, None
        self._tick += 1
        slot.last_used = self._tick
