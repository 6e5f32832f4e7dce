"""``nxdc.load``: an export directory loaded in this process (and, at tp > 1, in the worker
processes it starts) as a ``Model`` that generates from Python, with the options, defaults,
checks and one-line errors of ``nxdc generate`` (which is a thin layer over it).

    with nxdc.load("exports/smol") as llm:
        [done] = llm.generate("Once upon a time", max_new_tokens=32)
        print(done.text, done.finish_reason)

The generation options are the fields of ``GenerateOptions``: ``Model.generate`` and
``Model.stream`` list them in their signatures (what ``help()`` shows), and ``nxdc generate``
builds one from its flags, so an option is declared once, as its field."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import inspect
import json
import os
import typing
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from nxdc.errors import UserInputError

if TYPE_CHECKING:
    from nxdc.generation.loop import GenerationResult
    from nxdc.generation.sampling import SamplingParams
    from nxdc.manifest import Manifest

PathLike = str | os.PathLike
Prompts = str | Sequence[str] | Sequence[int] | Sequence[Sequence[int]]


@dataclass(frozen=True)
class GenerateOptions:
    """The keyword options of ``Model.generate`` and ``Model.stream`` (see ``Model.generate``),
    checked when made: ``UserInputError`` with ``nxdc generate``'s message for a bad one."""

    max_new_tokens: int = 64
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    do_sample: bool | None = None
    stop: str | Sequence[str] = ()
    chat: bool = False
    prompt_lookup: int | None = None
    draft: PathLike | None = None
    speculation_length: int | None = None

    def __post_init__(self):
        stops = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        object.__setattr__(self, "stop", stops)
        self.sampling  # noqa: B018 (checks temperature, top-k, top-p)
        if self.draft is not None and self.prompt_lookup is not None:
            raise UserInputError("--draft and --prompt-lookup are two ways to draft: pick one")
        if self.speculation_length is not None and self.draft is None and self.prompt_lookup is None:
            raise UserInputError("--speculation-length needs --draft or --prompt-lookup")

    @classmethod
    def pick(cls, values: dict[str, Any]) -> GenerateOptions:
        """The options named in ``values`` (a command's parameters), the rest at their defaults."""
        return cls(**{f.name: values[f.name] for f in dataclasses.fields(cls) if f.name in values})

    @property
    def sampling(self) -> SamplingParams:
        """Greedy or sampling, as ``nxdc generate`` takes it: ``do_sample`` None samples when
        ``temperature`` is not 0."""
        from nxdc.generation.sampling import SamplingParams

        do_sample = self.temperature != 0 if self.do_sample is None else self.do_sample
        temperature = self.temperature if do_sample or self.do_sample is not None else 1.0
        return SamplingParams(do_sample, temperature, self.top_k, self.top_p, self.seed).validate()


@dataclass(frozen=True)
class Completion:
    """One prompt's generation.

    ``text`` / ``token_ids``: what was generated (the prompt excluded; an ending EOS token has
    no text and is not in ``token_ids``). ``finish_reason``: ``"stop"`` (an EOS token or a stop
    string) or ``"length"`` (``max_new_tokens``, or the export's sequence length was reached),
    as OpenAI names it; ``stop_reason`` the cause, as ``nxdc generate --json`` names it:
    ``"eos"``, ``"stop"``, ``"length"`` or ``"max_seq"``. ``prompt_tokens``: the prompt's length
    in tokens (after the chat template).

    Times, in seconds from the start of the call: ``ttft_s`` until the first token (the
    prefill of every prompt of the call), ``total_s`` until this sequence finished;
    ``decode_tokens_per_s``: its tokens after the first per second of decoding. ``batch_stats``:
    the call's totals over all its prompts, as ``nxdc generate --json`` prints them under
    ``stats`` (and the speculation statistics of a speculative run)."""

    prompt: str
    text: str
    prompt_tokens: int
    token_ids: list[int]
    stop_reason: str
    finish_reason: str
    ttft_s: float
    total_s: float
    decode_tokens_per_s: float
    batch_stats: dict = field(default_factory=dict, repr=False)

    def to_dict(self) -> dict:
        """This completion as a row of ``nxdc generate --json``'s ``results``."""
        from nxdc.generation.loop import SequenceResult

        return {f.name: getattr(self, f.name) for f in dataclasses.fields(SequenceResult)}


class Stream(Iterator[str]):
    """The text of one generation, a piece at a time as it is produced (``Model.stream``);
    ``completion`` is its ``Completion`` once the iteration has ended. ``close()`` stops it
    early (leaving the model ready for the next call)."""

    def __init__(self, steps, pieces: collections.deque, finish):
        self._steps, self._pieces, self._finish = steps, pieces, finish
        self.completion: Completion | None = None

    def __next__(self) -> str:
        while not self._pieces and self.completion is None:
            try:
                next(self._steps)
            except StopIteration as done:
                self.completion = self._finish(done.value)[0]
        if self._pieces:
            return self._pieces.popleft()
        raise StopIteration

    def close(self) -> None:
        self._steps.close()


def _with_options(fn):
    """``fn(self, prompt, **options)`` with each ``GenerateOptions`` field as a keyword
    parameter in its signature (what ``help()`` and ``inspect`` read)."""
    sig = inspect.signature(fn)
    kept = [p for p in sig.parameters.values() if p.kind is not p.VAR_KEYWORD]
    hints = typing.get_type_hints(GenerateOptions)
    options = [
        inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default, annotation=hints[f.name])
        for f in dataclasses.fields(GenerateOptions)
    ]
    fn.__signature__ = sig.replace(parameters=[*kept, *options])
    return fn


class Model:
    """An export loaded for generation (``nxdc.load``). Use it as a context manager, or call
    ``close()``: at tp > 1 it owns the worker processes of ranks 1..tp-1, which stop with it.

    ``tokenizer``: the export's Hugging Face tokenizer; ``manifest``: its ``nxdc.json``
    (``nxdc.manifest.Manifest``: model spec, plan, graphs); ``config``: its ``config.json`` (the
    Hugging Face config of the model it holds) as a dict."""

    def __init__(self, export_dir: PathLike, runner, tokenizer, threads: int | None = None):
        self.export_dir = Path(export_dir)
        self.tokenizer = tokenizer
        self._runner, self._threads = runner, threads
        self._drafts: dict[str, Any] = {}  # draft exports, loaded on first use
        self._closed = False

    @property
    def manifest(self) -> Manifest:
        return self._runner.manifest

    @functools.cached_property
    def config(self) -> dict:
        return json.loads((self.export_dir / "config.json").read_text())

    @property
    def batch_size(self) -> int:
        """The most prompts one ``generate`` call takes."""
        return self._runner.batch_size

    @property
    def sequence_length(self) -> int:
        """The KV-cache length: prompt + generated tokens stop there."""
        return self._runner.max_seq

    @property
    def threads(self) -> int:
        """CPU threads this process computes with."""
        return self._runner.threads

    @_with_options
    def generate(self, prompts: Prompts, **options) -> list[Completion]:
        """Generate a completion for each prompt (1 to ``batch_size`` of them at once), as
        ``nxdc generate`` does.

        ``prompts``: a string, a list of strings, or token ids (a list of ints, or a list of
        such lists). Options (``nxdc generate``'s flags, same defaults but for sampling):

        - ``max_new_tokens``: at most this many new tokens; generation also stops at an EOS
          token, at a ``stop`` string (str or list; the text is cut where it begins) and at the
          export's sequence length.
        - ``temperature``, ``top_k``, ``top_p``, ``seed``: 0 (the default) is greedy; a
          temperature > 0 samples, top-k (0: off) and top-p (1: off) filtered; the same seed
          gives the same text. ``do_sample`` (None: temperature != 0) overrides that choice, as
          ``--do-sample`` does.
        - ``chat``: apply the tokenizer's chat template to each (text) prompt as a user turn.
        - ``prompt_lookup`` (max n-gram N) or ``draft`` (a draft export: same tokenizer,
          --tp 1): speculative decoding, ``speculation_length`` draft tokens per step (default:
          the export's --speculation-length K); greedy output is unchanged.

        Raises ``nxdc.errors.UserInputError`` with ``nxdc generate``'s message for a bad option
        or prompt (empty, longer than the largest context bucket, more prompts than the batch
        size)."""
        from nxdc.generation.loop import drain

        return self._finish(drain(self._start(prompts, GenerateOptions(**options))))

    @_with_options
    def stream(self, prompt: str | Sequence[int], **options) -> Stream:
        """Generate for one prompt and iterate over the text as it is produced (``nxdc generate
        --stream``): ``for piece in llm.stream("Hi"): print(piece, end="")``. The options are
        ``generate``'s; bad ones raise here, before the first piece. The returned ``Stream``'s
        ``completion`` holds the ``Completion`` once the iteration has ended."""
        if not isinstance(prompt, str) and not all(isinstance(t, int) for t in prompt):
            raise UserInputError("stream takes one prompt: a string or a list of token ids")
        pieces: collections.deque[str] = collections.deque()
        steps = self._start([prompt], GenerateOptions(**options), on_text=pieces.append)
        next(steps)  # the prefill: a prompt that does not fit is refused now
        return Stream(steps, pieces, self._finish)

    def close(self) -> None:
        """Stop the worker processes (tp > 1) and release the export. Idempotent."""
        if getattr(self, "_closed", True):
            return
        self._closed = True
        try:
            for draft in self._drafts.values():
                draft.close()
        finally:
            self._runner.close()

    def __enter__(self) -> Model:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        with contextlib.suppress(Exception):
            self.close()

    def __repr__(self) -> str:
        plan = self.manifest.plan
        state = "closed" if self._closed else f"tp {plan.tp}"
        return (
            f"<nxdc.Model {self.export_dir} batch {plan.batch_size}, {plan.sequence_length} tokens, {state}>"
        )

    # --- the generation loop ------------------------------------------------------------------
    def _start(self, prompts: Prompts, opts: GenerateOptions, on_text=None, eos_ids=None):
        """The generation's steps (``nxdc.generation.loop.start``), after every check."""
        from nxdc.generation.loop import start

        if self._closed:
            raise UserInputError(f"the model {self.export_dir} is closed: nxdc.load it again")
        texts, ids = self._prompts(prompts, opts.chat)
        speculator = self._speculator(opts)
        return start(
            self._runner,
            self.tokenizer,
            texts,
            opts.max_new_tokens,
            opts.sampling,
            list(opts.stop),
            opts.chat,
            on_text,
            eos_ids,
            ids,
            speculator,
        )

    def _prompts(self, prompts: Prompts, chat: bool) -> tuple[list[str], list[list[int]] | None]:
        """The prompts' texts, and their token ids where they were given as ids."""
        if isinstance(prompts, str):
            return [prompts], None
        prompts = list(prompts)
        if prompts and all(isinstance(t, int) for t in prompts):
            prompts = [prompts]  # one prompt of token ids
        if not prompts:
            raise UserInputError("give at least one prompt")
        if all(isinstance(p, str) for p in prompts):
            return prompts, None
        if not all(isinstance(p, Sequence) and all(isinstance(t, int) for t in p) for p in prompts):
            raise UserInputError("prompts are a string, a list of strings or lists of token ids")
        if chat:
            raise UserInputError("chat applies the chat template to text prompts, not to token ids")
        ids = [list(p) for p in prompts]
        return [self.tokenizer.decode(p) for p in ids], ids

    def _speculator(self, opts: GenerateOptions):
        """The drafter the options ask for (None: plain decoding)."""
        from nxdc.generation.speculative import DraftModel, PromptLookup, Speculator

        if opts.draft is None and opts.prompt_lookup is None:
            return None
        if opts.draft is not None:
            drafter = DraftModel(self._draft(opts.draft), self._runner)
        else:
            drafter = PromptLookup(opts.prompt_lookup)
        k = opts.speculation_length or self._runner.speculation_length or 1
        return Speculator(drafter, k, self._runner)

    def _draft(self, path: PathLike):
        from nxdc.runtime.runner import Runner
        from nxdc.runtime.tokenizer import load_tokenizer

        key = str(Path(path).resolve())
        if key not in self._drafts:
            if load_tokenizer(path).get_vocab() != self.tokenizer.get_vocab():
                raise UserInputError(f"the draft {path} has a different tokenizer from the target")
            self._drafts[key] = Runner.load(path, threads=self._threads)
        return self._drafts[key]

    @staticmethod
    def _finish(res: GenerationResult) -> list[Completion]:
        stats = res.to_dict()["stats"]
        done = []
        for s, end in zip(res.sequences, res.finish_s, strict=True):
            decode_s = end - res.ttft_s
            tps = (len(s.token_ids) - 1) / decode_s if len(s.token_ids) > 1 and decode_s > 0 else 0.0
            done.append(
                Completion(
                    **vars(s), ttft_s=res.ttft_s, total_s=end, decode_tokens_per_s=tps, batch_stats=stats
                )
            )
        return done


def load(export_dir: PathLike, *, threads: int | None = None) -> Model:
    """Load the export directory ``export_dir`` (written by ``nxdc export`` / ``nxdc.export``)
    for generation, as ``nxdc generate`` does: no recompilation.

    ``threads``: CPU threads (default ``NXDC_THREADS``, else the cores this process may use;
    at tp > 1, split between the ranks). At tp > 1 the ranks 1..tp-1 start here as worker
    processes; they stop when the model is closed, so use it as a context manager::

        with nxdc.load("exports/smol") as llm:
            print(llm.generate("Once upon a time")[0].text)

    Raises ``nxdc.errors.ExportDirError`` (a ``UserInputError``) for a directory that is not an
    export, is incomplete or corrupt, or was made by another torch version, with the message
    ``nxdc generate`` prints."""
    from nxdc.runtime.threads import parse_threads
    from nxdc.runtime.tokenizer import load_tokenizer
    from nxdc.runtime.workers import open_runner

    if threads is not None:
        threads = parse_threads(threads)
    runner = open_runner(export_dir, threads=threads)  # checks the manifest and versions first
    try:
        tokenizer = load_tokenizer(export_dir)
    except BaseException:
        runner.close()
        raise
    return Model(export_dir, runner, tokenizer, threads)
