"""The HTTP side of ``nxdc serve``: a Starlette app (run by uvicorn) that checks, tokenizes and
queues requests, and streams the engine process's tokens back. It never imports torch: the
engine (``engine_process.py``) runs the model, this process stays free to answer ``/health``
and to stream while a long prompt is being prefilled."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from nxdc.errors import UserInputError
from nxdc.manifest import Manifest, read_manifest
from nxdc.serve import api
from nxdc.serve.api import ApiError
from nxdc.serve.engine_process import EngineClient
from nxdc.serve.metrics import Metrics
from nxdc.serve.protocol import Abort, Done, Events, Failed, Fatal, Ready, Started, Submit, Token
from nxdc.serve.text import TextTokenizer

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


@dataclass(frozen=True)
class ServeConfig:
    export_dir: Path
    host: str = "127.0.0.1"
    port: int = 8000
    name: str | None = None  # --served-model-name (default: the export directory's name)
    api_key: str | None = None
    max_queue: int = 64  # running + queued requests before 429
    queue_timeout: float | None = None  # seconds a request may wait for a batch row
    request_timeout: float | None = None  # seconds a request may take in all
    prefill_chunk: int | None = None
    threads: int | None = None
    quiet: bool = False


@dataclass
class Pending:
    """A request the engine has: its events, and the times its metrics need."""

    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    arrival: float = field(default_factory=time.monotonic)
    last_token: float | None = None
    done: bool = False


def check_export(export_dir: Path) -> Manifest:
    """The manifest, if this export can be served (read without torch; the engine process checks
    the rest as it loads)."""
    m = read_manifest(export_dir)
    if not m.plan.chunks:
        raise UserInputError(
            f"{export_dir} has no single-row prefill graphs, which nxdc serve needs: re-export it with "
            "--chunk-buckets (e.g. --chunk-buckets 32,128,512, or --config configs/smollm2-135m-serve.toml)"
        )
    if not m.idle_rows:
        raise UserInputError(f"{export_dir} was exported by an nxdc without serving support: re-export it")
    return m


class Server:
    def __init__(self, cfg: ServeConfig):
        self.cfg = cfg
        plan = check_export(cfg.export_dir).plan
        self.max_seq, self.batch_size = plan.sequence_length, plan.batch_size
        self.name = cfg.name or cfg.export_dir.resolve().name
        self.tok = TextTokenizer(cfg.export_dir)
        self.metrics = Metrics(self.batch_size)
        self.state = "loading"  # loading | ready | draining | failed
        self.fatal: Fatal | None = None
        self.info: dict = {}
        self.slots: list[dict] = []
        self.pending: dict[str, Pending] = {}
        self.on_fatal = None  # called once the engine fails (the CLI stops uvicorn)
        self.engine = EngineClient(cfg.export_dir, cfg.threads, cfg.prefill_chunk, self._on_message)
        routes = [
            Route("/health", self.health, methods=["GET"]),
            Route("/metrics", self.prometheus, methods=["GET"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/slots", self.slot_states, methods=["GET"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
        ]
        self.app = Starlette(routes=routes, lifespan=self._lifespan)

    @contextlib.asynccontextmanager
    async def _lifespan(self, app):
        self.engine.start(asyncio.get_running_loop())
        try:
            yield
        finally:
            self.engine.close()

    # --- engine messages ----------------------------------------------------------------------
    def _on_message(self, msg) -> None:
        if isinstance(msg, Events):
            self._on_events(msg)
        elif isinstance(msg, Ready):
            self.state, self.info = "ready", msg.info
            if not self.cfg.quiet:
                i = msg.info
                sys.stderr.write(
                    f"nxdc serve: {self.name} ready on http://{self.cfg.host}:{self.cfg.port} "
                    f"(batch {i['batch_size']}, sequence {i['max_seq']}, prefill chunk {i['prefill_chunk']}, "
                    f"tp {i['tp']}, {i['threads']} threads)\n"
                )
                sys.stderr.flush()
        elif isinstance(msg, Fatal):
            self.state, self.fatal = "failed", msg
            for rid, p in list(self.pending.items()):
                p.events.put_nowait(Failed(rid, 503, "engine_failed", msg.message))
            if self.on_fatal is not None:
                self.on_fatal(msg)

    def _on_events(self, ev: Events) -> None:
        m, now = self.metrics, time.monotonic()
        m.step.observe(ev.step_s)
        if ev.decode_rows:
            m.busy_rows.observe(ev.decode_rows)
        m.running.set(ev.running)
        m.waiting.set(ev.waiting)
        if ev.slots is not None:
            self.slots = ev.slots
        for e in ev.events:
            p = self.pending.get(e.id)
            if p is None:  # aborted meanwhile
                continue
            if isinstance(e, Started):
                m.queue.observe(e.queue_s)
            elif isinstance(e, Token):
                m.generation_tokens.inc()
                if p.last_token is None:
                    m.ttft.observe(now - p.arrival)
                else:
                    m.itl.observe(now - p.last_token)
                p.last_token = now
            elif isinstance(e, Done):
                if p.last_token is None:  # finished on its first token (EOS): still its first token
                    m.generation_tokens.inc()
                    m.ttft.observe(now - p.arrival)
                m.e2e.observe(now - p.arrival)
                m.finished.labels(e.finish_reason).inc()
                m.prompt_tokens.inc(e.prompt_tokens)
                m.cached_tokens.inc(e.cached_tokens)
            elif isinstance(e, Failed):
                m.rejected.labels(e.code).inc()
            p.events.put_nowait(e)

    # --- plain endpoints ----------------------------------------------------------------------
    async def health(self, request: Request) -> Response:
        status = {"ready": "ok"}.get(self.state, self.state)
        return JSONResponse({"status": status}, status_code=200 if self.state == "ready" else 503)

    async def prometheus(self, request: Request) -> Response:
        return Response(self.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    async def models(self, request: Request) -> Response:
        try:
            self._check_key(request)
        except ApiError as e:
            return _error(e)
        card = {
            "id": self.name,
            "object": "model",
            "created": 0,
            "owned_by": "nxdc",
            "max_model_len": self.max_seq,
        }
        return JSONResponse({"object": "list", "data": [card]})

    async def slot_states(self, request: Request) -> Response:
        try:
            self._check_key(request)
        except ApiError as e:
            return _error(e)
        return JSONResponse({"slots": self.slots, "waiting": max(0, len(self.pending) - self._running())})

    def _running(self) -> int:
        return sum(s["state"] != "idle" for s in self.slots)

    # --- completions --------------------------------------------------------------------------
    async def completions(self, request: Request) -> Response:
        return await self._complete(request, chat=False)

    async def chat_completions(self, request: Request) -> Response:
        return await self._complete(request, chat=True)

    async def _complete(self, request: Request, chat: bool) -> Response:
        arrival = time.monotonic()
        try:
            self._check_key(request)
            self._check_state()
            try:
                body = json.loads(await request.body())
            except (ValueError, UnicodeDecodeError) as e:
                raise ApiError(400, f"the request body is not valid JSON ({e})") from None
            p = api.parse(body, chat)
            if p.model is not None and p.model != self.name:
                raise ApiError(
                    404,
                    f"model '{p.model}' does not exist: this server serves '{self.name}'",
                    "model",
                    "model_not_found",
                )
            ids = self._tokenize(p)
            max_tokens = self._budget(p, len(ids))
            if len(self.pending) >= self.cfg.max_queue:
                raise ApiError(
                    429,
                    f"{len(self.pending)} requests are running or queued (--max-queue): retry later",
                    code="queue_full",
                )
        except ApiError as e:
            self.metrics.rejected.labels(_reason(e)).inc()
            return _error(e)
        rid = api.new_id(chat)
        pend = self.pending[rid] = Pending(arrival=arrival)
        qt = self.cfg.queue_timeout
        self.engine.send(
            Submit(
                rid,
                tuple(ids),
                max_tokens,
                temperature=p.temperature,
                top_p=p.top_p,
                top_k=p.top_k,
                seed=p.seed,
                stop=p.stop,
                ignore_eos=p.ignore_eos,
                queue_deadline=arrival + qt if qt else None,
            )
        )
        if p.stream:
            return StreamingResponse(
                self._stream(p, rid, pend), media_type="text/event-stream", headers=SSE_HEADERS
            )
        return await self._collect(request, p, rid, pend)

    def _check_key(self, request: Request) -> None:
        key = self.cfg.api_key
        if key is None:
            return
        given = request.headers.get("authorization", "")
        token = given[7:] if given[:7].lower() == "bearer " else ""
        if not hmac.compare_digest(token.encode(), key.encode()):
            raise ApiError(
                401, "missing or wrong API key (Authorization: Bearer KEY)", code="invalid_api_key"
            )

    def _check_state(self) -> None:
        if self.state == "ready":
            return
        why = {
            "loading": "the model is still loading",
            "draining": "the server is shutting down",
            "failed": f"the engine failed: {self.fatal.message if self.fatal else ''}",
        }[self.state]
        raise ApiError(503, why, code=self.state)

    def _tokenize(self, p: api.Params) -> list[int]:
        try:
            if p.chat:
                return self.tok.encode_chat(p.messages)
            return p.prompt if isinstance(p.prompt, list) else self.tok.encode(p.prompt)
        except UserInputError as e:
            raise ApiError(400, str(e), "messages" if p.chat else "prompt") from None

    def _budget(self, p: api.Params, n_prompt: int) -> int:
        """``max_tokens`` (default: the room left), refused when the cache cannot hold it."""
        room = self.max_seq - n_prompt
        if room < 1:
            raise ApiError(
                400,
                f"this model's maximum context length is {self.max_seq} tokens; the prompt has {n_prompt}",
                "messages" if p.chat else "prompt",
                "context_length_exceeded",
            )
        if p.max_tokens is None:
            return room
        if p.max_tokens > room:
            raise ApiError(
                400,
                f"this model's maximum context length is {self.max_seq} tokens; you requested "
                f"{n_prompt + p.max_tokens} ({n_prompt} in the prompt, {p.max_tokens} to generate)",
                "max_tokens",
                "context_length_exceeded",
            )
        return p.max_tokens

    async def _next(self, rid: str, pend: Pending):
        """The request's next engine event; a request past --request-timeout is aborted."""
        limit = self.cfg.request_timeout
        if limit is None:
            return await pend.events.get()
        left = pend.arrival + limit - time.monotonic()
        try:
            return await asyncio.wait_for(pend.events.get(), max(left, 0.0))
        except TimeoutError:
            self._forget(rid, abort=True)
            self.metrics.finished.labels("timeout").inc()
            raise ApiError(
                503, f"the request took longer than {limit:g} s (--request-timeout)", code="request_timeout"
            ) from None

    def _forget(self, rid: str, abort: bool) -> None:
        pend = self.pending.pop(rid, None)
        if pend is not None and abort and not pend.done:
            pend.done = True
            self.engine.send(Abort(rid))
            self.metrics.finished.labels("abort").inc()

    async def _collect(self, request: Request, p: api.Params, rid: str, pend: Pending) -> Response:
        parts: list[str] = []
        gone = asyncio.ensure_future(_disconnect(request))
        try:
            while True:
                nxt = asyncio.ensure_future(self._next(rid, pend))
                await asyncio.wait({nxt, gone}, return_when=asyncio.FIRST_COMPLETED)
                if not nxt.done():  # the client went away
                    nxt.cancel()
                    return Response(status_code=499)
                try:
                    e = nxt.result()
                except ApiError as err:
                    return _error(err)
                if isinstance(e, Token):
                    parts.append(e.text)
                elif isinstance(e, Done):
                    pend.done = True
                    parts.append(e.text)
                    use = api.usage(e.prompt_tokens, e.completion_tokens, e.cached_tokens)
                    return JSONResponse(api.response(p, rid, self.name, "".join(parts), e.finish_reason, use))
                elif isinstance(e, Failed):
                    pend.done = True
                    return _error(ApiError(e.status, e.message, code=e.code))
        finally:
            gone.cancel()
            self._forget(rid, abort=True)

    async def _stream(self, p: api.Params, rid: str, pend: Pending):
        chunks = api.Chunks(p, rid, self.name)
        try:
            while True:
                try:
                    e = await self._next(rid, pend)
                except ApiError as err:
                    yield api.Chunks.error(err)
                    return
                if isinstance(e, Token):
                    if e.text:
                        yield chunks.text(e.text)
                elif isinstance(e, Done):
                    pend.done = True
                    if e.text:
                        yield chunks.text(e.text)
                    yield chunks.finish(
                        e.finish_reason, api.usage(e.prompt_tokens, e.completion_tokens, e.cached_tokens)
                    )
                    return
                elif isinstance(e, Failed):
                    pend.done = True
                    yield api.Chunks.error(ApiError(e.status, e.message, code=e.code))
                    return
        finally:  # also when the client disconnects (the response task is cancelled)
            self._forget(rid, abort=True)


async def _disconnect(request: Request) -> None:
    while True:
        msg = await request.receive()
        if msg["type"] == "http.disconnect":
            return


def _reason(e: ApiError) -> str:
    return e.code or {400: "bad_request", 401: "unauthorized"}.get(e.status, str(e.status))


def _error(e: ApiError) -> Response:
    headers = {"Retry-After": "1"} if e.status in (429, 503) else None
    return JSONResponse(e.body(), status_code=e.status, headers=headers)
