"""The HTTP side of ``nxdc serve``: a Starlette app (run by uvicorn) that checks, tokenizes and
queues requests, and streams the engine process's tokens back. It never imports torch: the
engine (``engine_process.py``) runs the model, this process stays free to answer ``/health``
and to stream while a long prompt is being prefilled.

No request can take the server down: a body is read up to ``--max-body-bytes``, parsed,
checked, tokenized and rendered in a thread pool (not on the event loop), every value is
checked against what the engine accepts, and every error, expected or not, is answered as
OpenAI error JSON and counted."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
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
    step_budget: float | None = None  # None: the engine's default (STEP_RATIO)
    threads: int | None = None
    max_body_bytes: int = 1 << 20  # larger bodies get 413
    quiet: bool = False


@dataclass
class Pending:
    """A request the engine has: its events, and the times its metrics need."""

    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    arrival: float = field(default_factory=time.monotonic)
    last_token: float | None = None
    tokens: int = 0  # Token events seen
    done: bool = False  # ended and counted (nxdc_requests_finished), once


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
        manifest = check_export(cfg.export_dir)
        self.max_seq, self.batch_size = manifest.plan.sequence_length, manifest.plan.batch_size
        self.vocab_size = manifest.spec.vocab_size
        self.name = cfg.name or cfg.export_dir.resolve().name
        self.tok = TextTokenizer(cfg.export_dir)
        # a text prompt longer than this cannot fit in max_seq tokens (x2: normalizers may merge)
        self.max_prompt_chars = 2 * self.max_seq * self.tok.max_token_chars
        self.metrics = Metrics(self.batch_size, self.name)
        self.pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="nxdc-request")
        self.state = "loading"  # loading | ready | draining | failed
        self.fatal: Fatal | None = None
        self.info: dict = {}
        self.slots: list[dict] = []
        self.pending: dict[str, Pending] = {}
        self.on_fatal = None  # called once the engine fails (the CLI stops uvicorn)
        options = {"threads": cfg.threads, "prefill-chunk": cfg.prefill_chunk, "step-budget": cfg.step_budget}
        self.engine = EngineClient(cfg.export_dir, options, self._on_message)
        routes = [
            Route("/health", self.health, methods=["GET"]),
            Route("/metrics", self.prometheus, methods=["GET"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/slots", self.slot_states, methods=["GET"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
        ]
        handlers = {HTTPException: self._http_error, Exception: self._unexpected}
        self.app = Starlette(routes=routes, lifespan=self._lifespan, exception_handlers=handlers)

    @contextlib.asynccontextmanager
    async def _lifespan(self, app):
        self.engine.start(asyncio.get_running_loop())
        try:
            yield
        finally:
            self.engine.close()
            self.pool.shutdown(wait=False, cancel_futures=True)

    async def _http_error(self, request: Request, exc: HTTPException) -> Response:
        """Starlette's own errors (unknown route: 404, wrong method: 405) as OpenAI error JSON."""
        what = {
            404: f"no route {request.url.path}",
            405: f"{request.method} is not allowed on {request.url.path}",
        }
        err = ApiError(exc.status_code, what.get(exc.status_code, str(exc.detail)))
        self.metrics.rejected.labels(_reason(err)).inc()
        return _error(err)

    async def _unexpected(self, request: Request, exc: Exception) -> Response:
        """The last resort: an error nxdc did not foresee is still JSON, a 500, and counted."""
        self.metrics.rejected.labels("internal_error").inc()
        return _error(_internal(exc))

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
                    f"(batch {i['batch_size']}, sequence {i['max_seq']}, prefill chunk {i['prefill_chunk']} "
                    f"({i['prefill_chunk_beside_decoding']} beside decoding streams), "
                    f"tp {i['tp']}, {i['threads']} threads)\n"
                )
                sys.stderr.flush()
        elif isinstance(msg, Fatal):
            self.state, self.fatal = "failed", msg
            self._on_events(Events([Failed(rid, 503, "engine_failed", msg.message) for rid in self.pending]))
            if self.on_fatal is not None:
                self.on_fatal(msg)

    def _on_events(self, ev: Events) -> None:
        m, now = self.metrics, time.monotonic()
        if ev.step_s:
            m.step.observe(ev.step_s)
        if ev.decode_rows:
            m.busy_rows.observe(ev.decode_rows)
        m.set_rows(ev.running, ev.waiting)
        if ev.slots is not None:
            self.slots = ev.slots
        for e in ev.events:
            p = self.pending.get(e.id)
            if p is None or p.done:  # aborted or timed out meanwhile
                continue
            if isinstance(e, Started):
                m.queue.observe(e.queue_s)
            elif isinstance(e, Token):
                m.generation_tokens.inc()
                p.tokens += 1
                if p.last_token is None:
                    m.ttft.observe(now - p.arrival)
                else:
                    m.itl.observe(now - p.last_token)
                p.last_token = now
            elif isinstance(e, Done):
                if p.last_token is None:  # finished on its first token (EOS): still its first token
                    m.ttft.observe(now - p.arrival)
                # tokens without a Token event (a final EOS): the total equals usage.completion_tokens
                m.generation_tokens.inc(max(0, e.completion_tokens - p.tokens))
                m.e2e.observe(now - p.arrival)
                m.prompt_tokens.inc(e.prompt_tokens)
                m.cached_tokens.inc(e.cached_tokens)
                self._end(e.id, p, e.finish_reason)
            elif isinstance(e, Failed):
                self._end(e.id, p, e.code)
            p.events.put_nowait(e)

    def _end(self, rid: str, pend: Pending, reason: str, abort: bool = False) -> None:
        """A request the engine took has ended: counted once, under one reason; ``abort``: the
        engine still has it and is told to drop it."""
        if pend.done:
            return
        pend.done = True
        self.metrics.finished.labels(reason).inc()
        if abort:
            self.engine.send(Abort(rid))

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
            raw = await self._read_body(request)
            loop = asyncio.get_running_loop()
            p, ids, max_tokens = await loop.run_in_executor(self.pool, self._prepare, raw, chat)
            self._check_state()  # again: the engine may have failed while the body was read
            if len(self.pending) >= self.cfg.max_queue:
                raise ApiError(
                    429,
                    f"{len(self.pending)} requests are running or queued (--max-queue): retry later",
                    code="queue_full",
                )
        except ApiError as e:
            self.metrics.rejected.labels(_reason(e)).inc()
            return _error(e)
        except Exception as e:  # a bug of nxdc's: still this request's alone
            self.metrics.rejected.labels("internal_error").inc()
            return _error(_internal(e))
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

    async def _read_body(self, request: Request) -> bytes:
        """The body, refused with 413 as soon as it is longer than --max-body-bytes."""
        limit = self.cfg.max_body_bytes
        too_big = ApiError(413, f"the request body is larger than {limit} bytes (--max-body-bytes)")
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise too_big
        parts, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise too_big
            parts.append(chunk)
        return b"".join(parts)

    def _prepare(self, raw: bytes, chat: bool) -> tuple[api.Params, list[int], int]:
        """Parse, check and tokenize one request (in the thread pool: none of it on the event
        loop) -> its parameters, prompt ids and ``max_tokens``."""
        p = api.parse(api.loads(raw), chat)
        if p.model is not None and p.model != self.name:
            raise ApiError(
                404,
                f"model '{p.model}' does not exist: this server serves '{self.name}'",
                "model",
                "model_not_found",
            )
        ids = self._tokenize(p)
        return p, ids, self._budget(p, len(ids))

    def _tokenize(self, p: api.Params) -> list[int]:
        param = "messages" if p.chat else "prompt"
        if isinstance(p.prompt, list):
            bad = next((t for t in p.prompt if not 0 <= t < self.vocab_size), None)
            if bad is not None:
                raise ApiError(
                    400,
                    f"token id {bad} is outside this model's vocabulary (0..{self.vocab_size - 1})",
                    param,
                )
            return p.prompt
        chars = len(p.prompt) if p.prompt is not None else sum(len(m["content"]) for m in p.messages)
        if chars > self.max_prompt_chars:
            raise ApiError(
                400,
                f"this model's maximum context length is {self.max_seq} tokens; the prompt has {chars} "
                f"characters, more than {self.max_seq} tokens can hold",
                param,
                "context_length_exceeded",
            )
        try:
            return self.tok.encode_chat(p.messages) if p.chat else self.tok.encode(p.prompt)
        except UserInputError as e:
            raise ApiError(400, str(e), param) from None

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
            self._end(rid, pend, "timeout", abort=True)
            raise ApiError(
                503, f"the request took longer than {limit:g} s (--request-timeout)", code="request_timeout"
            ) from None

    def _forget(self, rid: str, pend: Pending) -> None:
        """The response is over: a request still running (its client went away) is aborted."""
        self._end(rid, pend, "abort", abort=True)
        self.pending.pop(rid, None)

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
                    parts.append(e.text)
                    use = api.usage(e.prompt_tokens, e.completion_tokens, e.cached_tokens)
                    return JSONResponse(api.response(p, rid, self.name, "".join(parts), e.finish_reason, use))
                elif isinstance(e, Failed):
                    return _error(ApiError(e.status, e.message, code=e.code))
        finally:
            gone.cancel()
            self._forget(rid, pend)

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
                    if e.text:
                        yield chunks.text(e.text)
                    yield chunks.finish(
                        e.finish_reason, api.usage(e.prompt_tokens, e.completion_tokens, e.cached_tokens)
                    )
                    return
                elif isinstance(e, Failed):
                    yield api.Chunks.error(ApiError(e.status, e.message, code=e.code))
                    return
        except Exception as e:  # an error nxdc did not foresee ends this stream alone, as an event
            self.metrics.rejected.labels("internal_error").inc()
            yield api.Chunks.error(_internal(e))
        finally:  # also when the client disconnects (the response task is cancelled)
            self._forget(rid, pend)


async def _disconnect(request: Request) -> None:
    while True:
        msg = await request.receive()
        if msg["type"] == "http.disconnect":
            return


def _reason(e: ApiError) -> str:
    return e.code or {400: "bad_request", 401: "unauthorized", 404: "not_found", 413: "body_too_large"}.get(
        e.status, str(e.status)
    )


def _internal(e: Exception) -> ApiError:
    return ApiError(500, f"internal error in nxdc serve: {type(e).__name__}: {e}", code="internal_error")


def _error(e: ApiError) -> Response:
    headers = {"Retry-After": "1"} if e.status in (429, 503) else None
    return JSONResponse(e.body(), status_code=e.status, headers=headers)
