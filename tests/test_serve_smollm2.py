"""`nxdc serve` on SmolLM2 (8 rows, 1024 positions): the openai SDK's chat completions equal
`nxdc generate --chat`, clients that disconnect free their rows while the others finish,
/health stays responsive during a 1,000-token prefill, the queue limits answer 429 / 503, a
request past --request-timeout ends its stream with an error event, and SIGTERM drains."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import pytest
from serve_client import ServerProc, metric, parse_sse

from nxdc.runtime.runner import Runner

pytestmark = pytest.mark.slow

QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "Write a haiku about rain.",
    "What is 12 times 12?",
    "Give me a synonym for happy.",
    "Why is the sky blue?",
    "List two mammals that can fly or glide.",
    "What does a compiler do?",
]


@pytest.fixture(scope="module")
def server(smollm2_serve_export, tmp_path_factory):
    s = ServerProc(
        smollm2_serve_export, "--served-model-name", "smollm2", log_dir=tmp_path_factory.mktemp("logs")
    )
    s.wait_ready()
    yield s
    assert s.stop() == 0, s.stderr()


def test_openai_sdk_chat_matches_generate(server, smollm2_serve_export):
    from openai import OpenAI
    from transformers import AutoTokenizer

    from nxdc.generation.loop import generate

    runner, tok = Runner.load(smollm2_serve_export), AutoTokenizer.from_pretrained(smollm2_serve_export)
    client = OpenAI(base_url=server.url + "/v1", api_key="unused")
    for q in QUESTIONS[:2]:
        want = generate(runner, tok, [q], max_new_tokens=24, chat=True).sequences[0]
        msgs = [{"role": "user", "content": q}]
        res = client.chat.completions.create(model="smollm2", messages=msgs, max_tokens=24, temperature=0)
        assert res.choices[0].message.content == want.text
        assert res.usage.prompt_tokens == want.prompt_tokens
        stream = client.chat.completions.create(
            model="smollm2",
            messages=msgs,
            max_tokens=24,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = list(stream)
        assert chunks[0].choices[0].delta.role == "assistant"
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want.text
        assert chunks[-1].usage.completion_tokens == res.usage.completion_tokens
    raw = httpx.post(
        server.url + "/v1/chat/completions",
        json={
            "messages": [{"role": "user", "content": QUESTIONS[2]}],
            "max_tokens": 16,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        },  # fmt: skip
        timeout=60,
    )
    assert parse_sse(raw.text, chat=True, include_usage=True)["usage"]["completion_tokens"] <= 16


async def _streams(url: str, n: int, max_tokens: int, drop: set[int], on_started=None) -> list:
    """``n`` chat streams; once each has sent its first chunk, those in ``drop`` disconnect.
    Returns each stream's raw text (None for the dropped ones)."""
    started = asyncio.Event()
    count = [0]

    async def one(c: httpx.AsyncClient, i: int):
        body = {"messages": [{"role": "user", "content": QUESTIONS[i % 8]}], "max_tokens": max_tokens,
                "temperature": 0, "ignore_eos": True, "stream": True}  # fmt: skip
        async with c.stream("POST", "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            it = r.aiter_text()
            raw = await it.__anext__()
            count[0] += 1
            if count[0] == n:
                started.set()
            await started.wait()
            if i in drop:
                return None  # leaving the block closes the connection
            async for piece in it:
                raw += piece
            return raw

    async with httpx.AsyncClient(base_url=url, timeout=120) as c:
        tasks = [asyncio.create_task(one(c, i)) for i in range(n)]
        await started.wait()
        if on_started is not None:
            await on_started()
        return await asyncio.gather(*tasks)


def test_disconnected_streams_free_their_rows(server):
    seen = {}

    async def check_rows():
        # the 4 disconnects reach the engine within a step or two; on a loaded machine later
        async with httpx.AsyncClient(base_url=server.url) as c:
            for _ in range(100):
                await asyncio.sleep(0.1)
                seen["slots"] = (await c.get("/slots")).json()["slots"]
                if sum(s["state"] != "idle" for s in seen["slots"]) <= 4:
                    break

    raws = asyncio.run(_streams(server.url, 8, 80, drop={0, 2, 4, 6}, on_started=check_rows))
    busy = [s for s in seen["slots"] if s["state"] != "idle"]
    assert len(busy) == 4 and all(s["generated_tokens"] < 80 for s in busy)
    for i in (1, 3, 5, 7):
        got = parse_sse(raws[i], chat=True, include_usage=False)
        assert got["finish_reason"] == "length"
        alone = httpx.post(
            server.url + "/v1/chat/completions",
            json={
                "messages": [{"role": "user", "content": QUESTIONS[i]}],
                "max_tokens": 80,
                "temperature": 0,
                "ignore_eos": True,
            },  # fmt: skip
            timeout=60,
        ).json()
        assert got["text"] == alone["choices"][0]["message"]["content"]
    metrics = httpx.get(server.url + "/metrics").text
    assert metric(metrics, "nxdc_requests_finished_total", reason="abort") == 4


def test_health_answers_during_a_long_prefill(server):
    """/health is answered while the engine prefills: many answers fall strictly between two
    /slots reads that both show the long prompt still prefilling. An HTTP loop blocked by the
    prefill could answer none there (or one per prefill chunk). An ordering check, not a time
    bound, so a loaded machine cannot fail it."""
    prompt = " ".join(["The quick brown fox jumps over the lazy dog."] * 100)  # ~1,000 tokens
    result = {}

    def long_request():
        r = httpx.post(server.url + "/v1/completions", json={"prompt": prompt, "max_tokens": 4}, timeout=120)
        result["r"] = r

    def prefilling(c: httpx.Client) -> bool:
        slots = c.get("/slots").json()["slots"]
        return any(s["state"] == "prefilling" and s["prompt_tokens"] >= 950 for s in slots)

    t = threading.Thread(target=long_request)
    t.start()
    inside = answered = 0
    with httpx.Client(base_url=server.url, timeout=60) as c:
        while t.is_alive():
            before = prefilling(c)
            assert c.get("/health").status_code == 200
            answered += 1
            inside += before and prefilling(c)
            time.sleep(0.01)  # leave the engine its cores
    t.join()
    assert result["r"].status_code == 200, result["r"].text
    assert result["r"].json()["usage"]["prompt_tokens"] >= 950
    assert inside >= 10, (inside, answered)  # answered throughout the prefill, not after it


async def _until(c: httpx.AsyncClient, ok, timeout: float = 60.0) -> dict:
    """Poll /slots until ``ok(slots)``; fails after ``timeout`` (never a fixed sleep)."""
    deadline = time.monotonic() + timeout
    while True:
        slots = (await c.get("/slots")).json()
        if ok(slots):
            return slots
        assert time.monotonic() < deadline, f"/slots never reached the state: {slots}"
        await asyncio.sleep(0.02)


def test_queue_limits_timeouts_and_drain(smollm2_serve_export, tmp_path):
    s = ServerProc(
        smollm2_serve_export,
        "--max-queue", "9", "--queue-timeout", "1", "--request-timeout", "5",
        log_dir=tmp_path,
    )  # fmt: skip
    try:
        s.wait_ready()
        out = {}

        async def while_rows_are_busy():
            async with httpx.AsyncClient(base_url=s.url, timeout=30) as c:
                body = {"prompt": "Count to ten.", "max_tokens": 8}
                queued = asyncio.create_task(c.post("/v1/completions", json=body))  # no free row
                await _until(c, lambda slots: slots["waiting"] >= 1)
                out["full"] = await c.post("/v1/completions", json=body)  # 8 running + 1 queued
                out["queued"] = await queued

        raws = asyncio.run(_streams(s.url, 8, 900, drop=set(), on_started=while_rows_are_busy))
        full, queued = out["full"], out["queued"]
        assert full.status_code == 429 and full.headers["retry-after"] == "1"
        assert full.json()["error"]["code"] == "queue_full"
        assert queued.status_code == 503 and queued.json()["error"]["code"] == "queue_timeout"
        for raw in raws:  # 900 tokens take more than --request-timeout 5: an error event, then [DONE]
            events = raw.strip().split("\n\n")
            assert events[-1] == "data: [DONE]"
            assert '"code": "request_timeout"' in events[-2]
        # each request counted once, under one reason
        metrics = httpx.get(s.url + "/metrics").text
        finished = lambda reason: metric(metrics, "nxdc_requests_finished_total", reason=reason)  # noqa: E731
        assert (finished("timeout"), finished("queue_timeout"), finished("abort")) == (8, 1, 0)
        assert metric(metrics, "nxdc_requests_rejected_total", reason="queue_full") == 1

        # SIGTERM while a stream runs: no new connections, the stream finishes, exit 0
        async def all_idle():  # the timed-out streams' rows freed: the next decoding row is the new stream's
            async with httpx.AsyncClient(base_url=s.url, timeout=30) as c:
                await _until(c, lambda slots: all(x["state"] == "idle" for x in slots["slots"]))

        asyncio.run(all_idle())
        r = {}

        def stream():
            body = {"prompt": "Tell me a story.", "max_tokens": 60, "ignore_eos": True, "stream": True}
            r["raw"] = httpx.post(s.url + "/v1/completions", json=body, timeout=60).text

        t = threading.Thread(target=stream)
        t.start()

        async def decoding():
            async with httpx.AsyncClient(base_url=s.url, timeout=30) as c:
                await _until(c, lambda slots: any(x["state"] == "decoding" for x in slots["slots"]))

        asyncio.run(decoding())
        s.proc.send_signal(15)
        deadline = time.monotonic() + 30
        with pytest.raises(httpx.TransportError):  # the listening socket closes while the stream runs
            while time.monotonic() < deadline:
                httpx.get(s.url + "/health", timeout=2)
                time.sleep(0.02)
        t.join()
        assert parse_sse(r["raw"], chat=False, include_usage=False)["finish_reason"] == "length"
        assert s.proc.wait(30) == 0, s.stderr()
    finally:
        s.stop()
