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


def generate(
    session,
    tokenizer,
    prompts: list[str],
    max_new_tokens: int = 64,
    sampling: SamplingParams | None = None,
    stop: list[str] | None = None,
    chat: bool = False,
    on_text: Callable[[str], None] | None = None,
    eos_ids: set[int] | None = None,
    prompt_ids: list[list[int]] | None = None,
) -> GenerationResult:
    """Generate for up to ``session.batch_size`` prompts at once. ``on_text`` streams the
    first sequence's new text as it is produced."""
    if max_new_tokens < 1:
        raise UserInputError(f"--max-new-tokens must be >= 1 (got {max_new_tokens})")
    if len(prompts) > session.batch_size:
        raise UserInputError(
            f"{len(prompts)} prompts but this export's batch size is {session.batch_size}: "
            f"re-export with --batch-size {len(prompts)} or pass fewer prompts"
        )
    sampler = Sampler(sampling or SamplingParams())
    stops = list(stop or [])
    eos = set(eos_ids if eos_ids is not None else session.spec.eos_token_ids)
    if tokenizer.eos_token_id is not None and eos_ids is None:
        eos.add(int(tokenizer.eos_token_id))
    ids = prompt_ids if prompt_ids is not None else encode_prompts(tokenizer, prompts, chat)
    n = len(ids)
    lengths = [len(p) for p in ids]
    t0 = time.perf_counter()
    logits = session.prefill(ids)
    out: list[list[int]] = [[] for _ in range(n)]
    texts = [""] * n
    reasons: list[str | None] = [None] * n
    streamed = 0
    tokens = torch.zeros(session.batch_size, dtype=torch.int64)
    positions = torch.zeros(session.batch_size, dtype=torch.int64)
    res = GenerationResult()
    step = 0
    while True:
        nxt = sampler(logits[:n])
        res.token_s.append(time.perf_counter() - t0)
        if step == 0:
            res.ttft_s = time.perf_counter() - t0
            t_decode = time.perf_counter()
        for i in range(n):
            if reasons[i]:
                continue
            tok = int(nxt[i])
            if tok in eos:
                reasons[i] = "eos"
                continue
            out[i].append(tok)
            if stops or (on_text and i == 0):
                prev = len(texts[i])
                texts[i] = tokenizer.decode(out[i], skip_special_tokens=True)
                cut = find_stop(texts[i], stops, prev - max((len(s) for s in stops), default=0))
                if cut is not None:
                    texts[i] = texts[i][:cut]
                    reasons[i] = "stop"
            if not reasons[i] and len(out[i]) >= max_new_tokens:
                reasons[i] = "length"
            elif not reasons[i] and lengths[i] + len(out[i]) >= session.max_seq:
                reasons[i] = "max_seq"
        if on_text and n:
            # hold back a trailing partial UTF-8 character and any text a stop string may still claim
            hold = 0 if reasons[0] else max((len(s) for s in stops), default=0)
            upto = len(texts[0]) - hold
            if texts[0].endswith("\ufffd") and not reasons[0]:
                upto = min(upto, len(texts[0]) - 1)
            if upto > streamed:
                on_text(texts[0][streamed:upto])
                streamed = upto
        if all(reasons):
            break
        for i in range(session.batch_size):
            if i < n and not reasons[i]:
                tokens[i] = out[i][-1]
                positions[i] = lengths[i] + len(out[i]) - 1
        logits = session.decode(tokens, positions)
        step += 1
    end = time.perf_counter()
    res.decode_s = end - t_decode
    res.total_s = end - t0
    res.decode_steps = step
    for i in range(n):
        text = (
            texts[i]
            if (stops or (on_text and i == 0))
            else tokenizer.decode(out[i], skip_special_tokens=True)
        )
        res.sequences.append(SequenceResult(prompts[i], text, lengths[i], out[i], reasons[i] or "length"))
    return res
