"""Speculative decoding: a drafter proposes up to k tokens per sequence, the target scores
them all in one verify call (``Session.verify``: k+1 positions against the KV cache), and the
longest acceptable prefix is kept, plus one token from the target.

- Greedy: a draft token is kept while it equals the target's argmax at that position, then
  the target's own argmax is appended. The output is the plain greedy output, token for token.
- Sampling (standard speculative sampling): draft token x with draft probability q(x) is kept
  with probability min(1, p(x)/q(x)); on rejection a token is drawn from max(0, p - q)
  renormalised; after k acceptances one more is drawn from p. The output distribution is the
  target's (temperature / top-k / top-p applied to both p and q). Prompt lookup is a draft
  whose q is a point mass on its token.
- Batch > 1: every sequence accepts its own number of tokens; positions are per sequence.
- Caches: the target's verify call writes k+1 slots; slots past the accepted prefix are never
  read (a query attends only to slots up to its own position) and are overwritten next step.
  The draft model's cache is rewound the same way: before proposing, it is fed whatever part
  of the context it does not hold (1 token after a rejection, 2 after a full acceptance).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nxdc.errors import UserInputError
from nxdc.generation.sampling import Sampler, greedy


@dataclass
class SpeculationStats:
    mode: str
    k: int
    target_calls: int = 0  # verify calls plus plain decode steps
    sequence_steps: int = 0  # target calls x the sequences active in each
    proposed: int = 0
    accepted: int = 0
    tokens: int = 0  # tokens appended by those calls

    def to_dict(self) -> dict:
        return {
            "mode": self.mode,
            "speculation_length": self.k,
            "target_calls": self.target_calls,
            "proposed": self.proposed,
            "accepted": self.accepted,
            "acceptance_rate": round(self.accepted / self.proposed, 4) if self.proposed else 0.0,
            "accepted_per_call": round(self.accepted / self.sequence_steps, 3)
            if self.sequence_steps
            else 0.0,
            # per sequence: 1 (nothing accepted) to k + 1 (every draft token accepted)
            "tokens_per_call": round(self.tokens / self.sequence_steps, 3) if self.sequence_steps else 0.0,
        }


class PromptLookup:
    """Drafts from the text itself: the tokens that followed the most recent earlier occurrence
    of the context's last n-gram (n = ``max_ngram`` down to 1). No model, no cost."""

    mode = "prompt-lookup"

    def __init__(self, max_ngram: int = 3):
        if max_ngram < 1:
            raise UserInputError(f"--prompt-lookup must be >= 1 (got {max_ngram})")
        self.max_ngram = max_ngram

    def start(self, prompts: list[list[int]]) -> None:
        pass

    def propose(self, contexts: dict[int, list[int]], k: int, sampler: Sampler):
        return {i: self._lookup(ctx, k) for i, ctx in contexts.items()}, None

    def _lookup(self, ctx: list[int], k: int) -> list[int]:
        for n in range(min(self.max_ngram, len(ctx) - 1), 0, -1):
            tail = ctx[-n:]
            for s in range(len(ctx) - n - 1, -1, -1):  # most recent earlier match first
                if ctx[s : s + n] == tail:
                    return ctx[s + n : s + n + k]
        return []


class DraftModel:
    """Drafts with a smaller exported model (same tokenizer) run one token at a time."""

    mode = "draft"

    def __init__(self, runner, target):
        for what, a, b in (
            ("vocabulary size", runner.spec.vocab_size, target.spec.vocab_size),
            ("batch size", runner.batch_size, target.batch_size),
        ):
            if a != b:
                raise UserInputError(f"the draft export's {what} is {a}, the target's is {b}")
        if runner.max_seq < target.max_seq:
            raise UserInputError(
                f"the draft export's sequence length ({runner.max_seq}) is shorter than the "
                f"target's ({target.max_seq}): re-export the draft with --sequence-length {target.max_seq}"
            )
        if runner.plan.tp != 1:
            raise UserInputError("the draft export must be --tp 1 (it runs in rank 0's process)")
        self.runner = runner
        self.cached: list[list[int]] = []  # per sequence: the tokens whose keys/values the draft holds

    def start(self, prompts: list[list[int]]) -> None:
        self.runner.prefill(prompts)
        self.cached = [list(p) for p in prompts]

    def propose(self, contexts: dict[int, list[int]], k: int, sampler: Sampler):
        b = self.runner.batch_size
        pending: dict[int, list[tuple[int, int]]] = {}  # (token, position) to feed, per sequence
        for i, ctx in contexts.items():
            have = self.cached[i]
            c = 0
            limit = min(len(have), len(ctx) - 1)  # the newest token is always fed: its logits draft
            while c < limit and have[c] == ctx[c]:
                c += 1
            pending[i] = [(ctx[p], p) for p in range(c, len(ctx))]
            self.cached[i] = ctx[:c]
        drafts: dict[int, list[int]] = {i: [] for i in contexts}
        qs = {i: [] for i in contexts} if sampler.params.do_sample else None
        tokens = torch.zeros(b, dtype=torch.int64)
        positions = torch.full((b,), -1, dtype=torch.int64)  # rows not drafting are idle
        # Lockstep: a sequence with fewer tokens to catch up starts later, re-feeding its first
        # one meanwhile (same token, same slot: idempotent); then k - 1 draft tokens are fed.
        most = max(len(f) for f in pending.values())
        for s in range(most + k - 1):
            for i, feed in pending.items():
                local = s - (most - len(feed))
                if local < len(feed):
                    tokens[i], positions[i] = feed[max(local, 0)]
                else:
                    j = local - len(feed)  # feed draft j at the slot after the context
                    tokens[i], positions[i] = drafts[i][j], feed[-1][1] + 1 + j
            logits = self.runner.decode(tokens, positions)
            for i, feed in pending.items():
                if s - (most - len(feed)) < len(feed) - 1:
                    continue  # still catching up: these logits draft nothing
                if qs is not None:
                    q = sampler.probs(logits[i])
                    qs[i].append(q)
                    drafts[i].append(int(sampler.draw(q)))
                else:
                    drafts[i].append(int(greedy(logits[i])))
        for i, feed in pending.items():
            self.cached[i] = self.cached[i] + [t for t, _ in feed] + drafts[i][:-1]
        return drafts, qs


class Speculator:
    def __init__(self, drafter, k: int, target):
        if target.speculation_length < 1:
            raise UserInputError(
                "this export has no verify graph: re-export the target with --speculation-length K"
            )
        if not 1 <= k <= target.speculation_length:
            raise UserInputError(
                f"--speculation-length must be 1..{target.speculation_length} for this export (got {k})"
            )
        self.drafter, self.k = drafter, k
        self.stats = SpeculationStats(drafter.mode, k)

    def start(self, prompts: list[list[int]]) -> None:
        self.drafter.start(prompts)

    def step(self, runner, outs, sampler: Sampler) -> None:
        from nxdc.generation.loop import decode_step

        active = [i for i in range(outs.n) if outs.active(i)]
        big_k = runner.speculation_length
        before = sum(len(outs.out[i]) for i in active)
        self.stats.target_calls += 1
        self.stats.sequence_steps += len(active)
        if any(outs.position(i) + big_k >= runner.max_seq for i in active):
            decode_step(runner, outs, sampler)  # a verify call would write past the cache
        else:
            drafts, qs = self.drafter.propose({i: outs.context(i) for i in active}, self.k, sampler)
            if not any(drafts.values()):
                decode_step(runner, outs, sampler)
            else:
                self._verify(runner, outs, sampler, active, drafts, qs)
        self.stats.tokens += sum(len(outs.out[i]) for i in active) - before

    def _verify(self, runner, outs, sampler, active, drafts, qs) -> None:
        big_k = runner.speculation_length
        tokens = torch.zeros(runner.batch_size, big_k + 1, dtype=torch.int64)
        start = torch.full((runner.batch_size,), -1, dtype=torch.int64)  # idle rows write nothing
        for i in active:
            d = drafts[i]
            tokens[i, 0], start[i] = outs.out[i][-1], outs.position(i)
            tokens[i, 1 : 1 + len(d)] = torch.tensor(d, dtype=torch.int64)
        logits = runner.verify(tokens, start)
        for i in active:
            d = drafts[i]
            self.stats.proposed += len(d)
            accepted, tok = accept(logits[i], d, qs[i] if qs is not None else None, sampler)
            self.stats.accepted += accepted
            for t in d[:accepted] + [tok]:
                if not outs.push(i, t):
                    break


def accept(logits: torch.Tensor, draft: list[int], q: list[torch.Tensor] | None, sampler: Sampler):
    """How many of ``draft`` the target keeps, and the token it appends after them.

    ``logits`` [>= len(draft) + 1, vocab] are the target's at the newest token and each draft
    token; ``q`` the draft's distributions (None: a deterministic draft such as prompt lookup,
    whose q is a point mass)."""
    if not sampler.params.do_sample:
        for j, x in enumerate(draft):
            best = int(greedy(logits[j]))
            if best != x:
                return j, best
        return len(draft), int(greedy(logits[len(draft)]))
    for j, x in enumerate(draft):
        p = sampler.probs(logits[j])
        qx = 1.0 if q is None else float(q[j][x])
        if sampler.uniform() < min(1.0, float(p[x]) / qx):
            continue
        if q is None:
            residual = p.clone()
            residual[x] = 0.0
        else:
            residual = (p - q[j]).clamp_min(0.0)
        total = float(residual.sum())
        return j, int(sampler.draw(residual / total if total > 0 else p))
    return len(draft), int(sampler.draw(sampler.probs(logits[len(draft)])))
