"""What the HTTP process and the engine process say to each other (pickled over one socket
pair; plain data, no torch)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Submit:
    """A request, tokenized and validated by the HTTP process."""

    id: str
    prompt_ids: tuple[int, ...]
    max_tokens: int
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    queue_deadline: float | None = None  # time.monotonic() by which it must have started


@dataclass(frozen=True)
class Abort:
    id: str


@dataclass(frozen=True)
class Shutdown:
    pass


# engine -> HTTP: one ``Events`` per engine iteration, or ``Ready`` / ``Fatal`` once at start


@dataclass(frozen=True)
class Ready:
    info: dict


@dataclass(frozen=True)
class Fatal:
    message: str
    exit_code: int = 1


@dataclass(frozen=True)
class Started:
    id: str
    row: int
    cached_tokens: int  # prompt tokens the row already held (prefix reuse)
    queue_s: float


@dataclass(frozen=True)
class Token:
    """One sampled token of request ``id``: ``text`` is what it completes (may be empty: held
    back as part of a character or a possible stop string)."""

    id: str
    text: str


@dataclass(frozen=True)
class Done:
    id: str
    finish_reason: str  # stop | length
    text: str  # the rest of the text, released at the end
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


@dataclass(frozen=True)
class Failed:
    id: str
    status: int
    code: str
    message: str


@dataclass
class Events:
    events: list = field(default_factory=list)
    step_s: float = 0.0  # the iteration's engine time
    decode_rows: int = 0  # busy rows in its decode step (0: none ran)
    prefill_tokens: int = 0  # prompt tokens its prefill chunk took
    running: int = 0
    waiting: int = 0
    slots: list[dict] | None = None  # per-row state, when it changed
