"""The generation loop: prefill (smallest bucket that fits) -> decode steps -> sample -> stop."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from nxdc.errors import UserInputError
from nxdc.generation.sampling import Sampler, SamplingParams
from nxdc.generation.stopping import find_stop


@dataclass
class SequenceResult:
    prompt: str
    text: str
    prompt_tokens: int
    token_ids: list[int]
    stop_reason: str  # eos | stop | length | max_seq


@dataclass
class GenerationResult:
    sequences: list[SequenceResult] = field(default_factory=list)
    ttft_s: float = 0.0
    decode_s: float = 0.0
    total_s: float = 0.0
    decode_steps: int = 0
    token_s: list[float] = field(default_factory=list)  # when each step's tokens were sampled, from start
    speculation: dict | None = None  # acceptance statistics of a speculative run

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
    """Per-sequence bookkeeping shared by plain and speculative decoding: append a token, apply
    EOS / stop strings / length limits, stream the first sequence's text."""

    def __init__(self, tokenizer, ids, max_new_tokens, max_seq, eos, stops, on_text):
        self.tokenizer, self.ids, self.max_new, self.max_seq = tokenizer, ids, max_new_tokens, max_seq
        self.eos, self.stops, self.on_text = eos, stops, on_text
        n = len(ids)
        self.lengths = [len(p) for p in ids]
        self.out: list[list[int]] = [[] for _ in range(n)]
        self.texts = [""] * n
        self.reasons: list[str | None] = [None] * n
        self.streamed = 0

    @property
    def n(self) -> int:
        return len(self.ids)

    def active(self, i: int) -> bool:
        return self.reasons[i] is None

    @property
    def done(self) -> bool:
        return all(self.reasons)

    def context(self, i: int) -> list[int]:
        return self.ids[i] + self.out[i]

    def position(self, i: int) -> int:
        """Cache position of sequence ``i``'s newest token (the next one a graph call feeds)."""
        return self.lengths[i] + len(self.out[i]) - 1

    def push(self, i: int, tok: int) -> bool:
        """Append ``tok`` to sequence ``i``; False once the sequence has finished."""
        if self.reasons[i]:
            return False
        if tok in self.eos:
            self.reasons[i] = "eos"
            return False
        self.out[i].append(tok)
        stops = self.stops
        if stops or (self.on_text and i == 0):
            prev = len(self.texts[i])
            self.texts[i] = self.tokenizer.decode(self.out[i], skip_special_tokens=True)
            cut = find_stop(self.texts[i], stops, prev - max((len(s) for s in stops), default=0))
            if cut is not None:
                self.texts[i] = self.texts[i][:cut]
                self.reasons[i] = "stop"
        if not self.reasons[i] and len(self.out[i]) >= self.max_new:
            self.reasons[i] = "length"
        elif not self.reasons[i] and self.lengths[i] + len(self.out[i]) >= self.max_seq:
            self.reasons[i] = "max_seq"
        return self.reasons[i] is None

    def flush(self) -> None:
        """Stream the first sequence's settled text: hold back a trailing partial UTF-8
        character and any text a stop string may still claim."""
        if not self.on_text or not self.n:
            return
        text, done = self.texts[0], self.reasons[0] is not None
        upto = len(text) - (0 if done else max((len(s) for s in self.stops), default=0))
        if text.endswith("\ufffd") and not done:
            upto = min(upto, len(text) - 1)
        if upto > self.streamed:
            self.on_text(text[self.streamed : upto])
            self.streamed = upto

    def results(self, prompts: list[str]) -> list[SequenceResult]:
        def text(i: int) -> str:  # texts[] is kept up to date only where stops or streaming need it
            if self.stops or (self.on_text and i == 0):
                return self.texts[i]
            return self.tokenizer.decode(self.out[i], skip_special_tokens=True)

        return [
            SequenceResult(
                prompts[i],
                text(i),
                self.lengths[i],
                self.out[i],
                self.reasons[i] or "length",
            )
            for i in range(self.n)
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


def generate(
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
) -> GenerationResult:
    """Generate for up to ``runner.batch_size`` prompts at once (``runner``:
    ``nxdc.runtime.runner.Runner``). ``on_text`` streams the
    first sequence's new text as it is produced; ``speculator``
    (``nxdc.generation.speculative.Speculator``) drafts several tokens per target call."""
    if max_new_tokens < 1:
        raise UserInputError(f"--max-new-tokens must be >= 1 (got {max_new_tokens})")
    if len(prompts) > runner.batch_size:
        raise UserInputError(
            f"{len(prompts)} prompts but this export's batch size is {runner.batch_size}: "
            f"re-export with --batch-size {len(prompts)} or pass fewer prompts"
        )
    sampler = Sampler(sampling or SamplingParams())
    eos = set(eos_ids if eos_ids is not None else runner.spec.eos_token_ids)
    if tokenizer.eos_token_id is not None and eos_ids is None:
        eos.add(int(tokenizer.eos_token_id))
    ids = prompt_ids if prompt_ids is not None else encode_prompts(tokenizer, prompts, chat)
    outs = Outputs(tokenizer, ids, max_new_tokens, runner.max_seq, eos, list(stop or []), on_text)
    res = GenerationResult()
    t0 = time.perf_counter()
    logits = runner.prefill(ids)
    if speculator is not None:
        speculator.start(ids)
    for i, tok in enumerate(sampler(logits[: outs.n]).tolist()):
        outs.push(i, tok)
    res.ttft_s = time.perf_counter() - t0
    res.token_s.append(res.ttft_s)
    t_decode = time.perf_counter()
    outs.flush()
    while not outs.done:
        if speculator is not None:
            speculator.step(runner, outs, sampler)
        else:
            decode_step(runner, outs, sampler)
        res.token_s.append(time.perf_counter() - t0)
        res.decode_steps += 1
        outs.flush()
    end = time.perf_counter()
    res.decode_s = end - t_decode
    res.total_s = end - t0
    res.sequences = outs.results(prompts)
    if speculator is not None:
        res.speculation = speculator.stats.to_dict()
    return res
