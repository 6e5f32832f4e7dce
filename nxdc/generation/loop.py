"""The generation loop: prefill (smallest bucket that fits) -> decode steps -> sample -> stop."""

from __future__ import annotations

import time
from collections.abc import Callable, Generator
from dataclasses import dataclass, field

import torch

from nxdc.errors import UserInputError
from nxdc.generation.sampling import Sampler, SamplingParams
from nxdc.generation.text import TextStream
from nxdc.generation.text import eos_ids as model_eos_ids


@dataclass
class SequenceResult:
    prompt: str
    text: str
    prompt_tokens: int
    token_ids: list[int]
    stop_reason: str  # eos | stop | length | max_seq: the cause, as --json has always named it
    finish_reason: str  # stop | length (OpenAI's)


# a TextStream's cause -> SequenceResult.stop_reason
STOP_REASONS = {"eos": "eos", "stop_string": "stop", "max_new_tokens": "length", "max_seq": "max_seq"}


@dataclass
class GenerationResult:
    sequences: list[SequenceResult] = field(default_factory=list)
    ttft_s: float = 0.0
    decode_s: float = 0.0
    total_s: float = 0.0
    decode_steps: int = 0
    token_s: list[float] = field(default_factory=list)  # when each step's tokens were sampled, from start
    speculation: dict | None = None  # acceptance statistics of a speculative run
    # per sequence (not in to_dict): when it finished, from start; the EOS token that ended it
    finish_s: list[float] = field(default_factory=list)
    eos_tokens: list[int | None] = field(default_factory=list)

    @property
    def inter_token_s(self) -> list[float]:
        return [b - a for a, b in zip(self.token_s[:-1], self.token_s[1:], strict=True)]

    @property
    def new_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.sequences)

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens produced by decode steps per second, summed over the batch."""
        n = sum(max(0, len(s.token_ids) - 1) for s in self.sequences)
        return n / self.decode_s if self.decode_s > 0 else 0.0

    def to_dict(self) -> dict:
        return {
            "results": [vars(s) for s in self.sequences],
            "stats": {
                "prompt_tokens": sum(s.prompt_tokens for s in self.sequences),
                "new_tokens": self.new_tokens,
                "ttft_s": round(self.ttft_s, 4),
                "decode_s": round(self.decode_s, 4),
                "decode_tokens_per_s": round(self.decode_tokens_per_s, 2),
                "total_s": round(self.total_s, 4),
                **({"speculation": self.speculation} if self.speculation else {}),
            },
        }


def encode_prompts(tokenizer, prompts: list[str], chat: bool) -> list[list[int]]:
    if chat:
        if not getattr(tokenizer, "chat_template", None):
            raise UserInputError("--chat: this model's tokenizer has no chat template")
        out = []
        for p in prompts:
            ids = tokenizer.apply_chat_template(
                [{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True
            )
            if hasattr(ids, "keys"):  # transformers>=5 returns a BatchEncoding
                ids = ids["input_ids"]
            out.append(list(ids))
        return out
    return [list(tokenizer(p)["input_ids"]) for p in prompts]


class Outputs:
    """Per-sequence bookkeeping shared by plain and speculative decoding: append a token, let the
    sequence's ``TextStream`` apply EOS / stop strings / length limits, stream the first
    sequence's text."""

    def __init__(self, tokenizer, ids, max_new_tokens, max_seq, eos, stops, on_text):
        self.ids, self.on_text = ids, on_text
        self.lengths = [len(p) for p in ids]
        self.out: list[list[int]] = [[] for _ in ids]
        self.texts = [""] * len(ids)
        self.streams = [
            TextStream(
                tokenizer,
                max_new_tokens=max_new_tokens,
                eos=eos,
                stops=stops,
                room=max_seq - n,
                live=bool(on_text) and i == 0,
            )
            for i, n in enumerate(self.lengths)
        ]
        self.streamed = 0
        self.finished_at: list[float | None] = [None] * len(ids)  # time.perf_counter()
        self.ended_by: list[int | None] = [None] * len(ids)  # the EOS token, when one ended it

    @property
    def n(self) -> int:
        return len(self.ids)

    def active(self, i: int) -> bool:
        return not self.streams[i].finished

    @property
    def done(self) -> bool:
        return all(s.finished for s in self.streams)

    def context(self, i: int) -> list[int]:
        return self.ids[i] + self.out[i]

    def position(self, i: int) -> int:
        """Cache position of sequence ``i``'s newest token (the next one a graph call feeds)."""
        return self.lengths[i] + len(self.out[i]) - 1

    def push(self, i: int, tok: int) -> bool:
        """Append ``tok`` to sequence ``i`` (an EOS token ends it unappended); False once the
        sequence has finished."""
        stream = self.streams[i]
        if stream.finished:
            return False
        piece = stream.push(tok)
        if piece.text is not None:
            self.out[i].append(tok)
            self.texts[i] += piece.text
        else:
            self.ended_by[i] = tok
        self.texts[i] += piece.rest
        if stream.finished:
            self.finished_at[i] = time.perf_counter()
        return not stream.finished

    def flush(self) -> None:
        """Stream the first sequence's new text (its ``TextStream`` holds back a partial
        character and any text a stop string may still claim)."""
        if self.on_text and self.n and len(self.texts[0]) > self.streamed:
            self.on_text(self.texts[0][self.streamed :])
            self.streamed = len(self.texts[0])

    def results(self, prompts: list[str]) -> list[SequenceResult]:
        return [
            SequenceResult(
                prompts[i],
                self.texts[i],
                self.lengths[i],
                self.out[i],
                STOP_REASONS[s.cause],
                s.finish_reason,
            )
            for i, s in enumerate(self.streams)
        ]


def decode_step(runner, outs: Outputs, sampler: Sampler) -> None:
    """One plain decode step: every active sequence's newest token in, one new token each out
    (finished sequences and unused batch rows are idle: position -1)."""
    tokens = torch.zeros(runner.batch_size, dtype=torch.int64)
    positions = torch.full((runner.batch_size,), -1, dtype=torch.int64)
    active = [i for i in range(outs.n) if outs.active(i)]
    for i in active:
        tokens[i], positions[i] = outs.out[i][-1], outs.position(i)
    nxt = sampler(runner.decode(tokens, positions)[active])
    for i, tok in zip(active, nxt.tolist(), strict=True):
        outs.push(i, tok)


def generate(*args, **kwargs) -> GenerationResult:
    """Generate for up to ``runner.batch_size`` prompts at once: ``start``'s arguments, the
    request run to its end."""
    return drain(start(*args, **kwargs))


def drain(steps: Generator[Outputs, None, GenerationResult]) -> GenerationResult:
    """Run a generation's steps (``start``) to the end: its result."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value


def start(
    runner,
    tokenizer,
    prompts: list[str],
    max_new_tokens: int = 64,
    sampling: SamplingParams | None = None,
    stop: list[str] | None = None,
    chat: bool = False,
    on_text: Callable[[str], None] | None = None,
    eos_ids: set[int] | None = None,
    prompt_ids: list[list[int]] | None = None,
    speculator=None,
) -> Generator[Outputs, None, GenerationResult]:
    """Generate for up to ``runner.batch_size`` prompts at once (``runner``:
    ``nxdc.runtime.runner.Runner``), a step at a time. ``on_text`` streams the first sequence's
    new text as it is produced; ``speculator`` (``nxdc.generation.speculative.Speculator``)
    drafts several tokens per target call. The request is checked and encoded now; the generator
    returned runs it, yielding the ``Outputs`` after the prefill and after each decode step
    (``on_text`` has been given that step's text by then), and returns the ``GenerationResult``.
    Closing it early leaves the runner ready for the next request."""
    if max_new_tokens < 1:
        raise UserInputError(f"--max-new-tokens must be >= 1 (got {max_new_tokens})")
    if len(prompts) > runner.batch_size:
        raise UserInputError(
            f"{len(prompts)} prompts but this export's batch size is {runner.batch_size}: "
            f"re-export with --batch-size {len(prompts)} or pass fewer prompts"
        )
    sampler = Sampler(sampling or SamplingParams())
    eos = set(eos_ids) if eos_ids is not None else model_eos_ids(runner.spec.eos_token_ids, tokenizer)
    ids = prompt_ids if prompt_ids is not None else encode_prompts(tokenizer, prompts, chat)
    outs = Outputs(tokenizer, ids, max_new_tokens, runner.max_seq, eos, list(stop or []), on_text)
    return _run(runner, outs, sampler, prompts, speculator)


def _run(runner, outs: Outputs, sampler: Sampler, prompts, speculator):
    res = GenerationResult()
    t0 = time.perf_counter()
    logits = runner.prefill(outs.ids)
    if speculator is not None:
        speculator.start(outs.ids)
    for i, tok in enumerate(sampler(logits[: outs.n]).tolist()):
        outs.push(i, tok)
    res.ttft_s = time.perf_counter() - t0
    res.token_s.append(res.ttft_s)
    t_decode = time.perf_counter()
    outs.flush()
    yield outs
    while not outs.done:
        if speculator is not None:
            speculator.step(runner, outs, sampler)
        else:
            decode_step(runner, outs, sampler)
        res.token_s.append(time.perf_counter() - t0)
        res.decode_steps += 1
        outs.flush()
        yield outs
    end = time.perf_counter()
    res.decode_s = end - t_decode
    res.total_s = end - t0
    res.sequences = outs.results(prompts)
    res.finish_s = [t - t0 for t in outs.finished_at]
    res.eos_tokens = list(outs.ended_by)
    if speculator is not None:
        res.speculation = speculator.stats.to_dict()
    return res
