"""Helpers for the `nxdc serve` tests: a server in a subprocess on a free port, and a strict
parser of OpenAI server-sent events."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProc:
    """``nxdc serve EXPORT ARGS`` in a subprocess (stderr to a file, read on failure)."""

    def __init__(self, export: Path, *args: str, log_dir: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log_dir / f"serve-{self.port}.log"
        cmd = [sys.executable, "-m", "nxdc.cli.main", "serve", str(export), "--port", str(self.port), *args]
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.DEVNULL, stderr=self.log.open("w"), env=os.environ
        )

    def stderr(self) -> str:
        return self.log.read_text()

    def wait_ready(self, timeout: float = 180) -> list[int]:
        """Poll /health until 200; returns every status seen."""
        seen, deadline = [], time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"server exited {self.proc.returncode}: {self.stderr()}")
            try:
                code = httpx.get(self.url + "/health", timeout=5).status_code
                seen.append(code)
                if code == 200:
                    return seen
            except httpx.TransportError:
                pass
            time.sleep(0.05)
        raise AssertionError(f"server not ready in {timeout} s: {self.stderr()}")

    def stop(self, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def parse_sse(raw: str, chat: bool, include_usage: bool) -> dict:
    """Check an OpenAI stream strictly and return its text, finish reason and usage: every event
    is ``data: <json>`` + a blank line; content chunks (chat: the first carries the role), one
    chunk with ``finish_reason`` after all content, then the usage chunk (``choices: []``) when
    asked for, and ``data: [DONE]`` last."""
    assert raw.endswith("\n\n"), raw[-50:]
    events = raw[:-2].split("\n\n")
    assert all(e.startswith("data: ") and "\n" not in e for e in events), events
    assert events[-1] == "data: [DONE]"
    bodies = [json.loads(e[6:]) for e in events[:-1]]
    ids = {b["id"] for b in bodies}
    assert len(ids) == 1
    kind = "chat.completion.chunk" if chat else "text_completion"
    assert all(b["object"] == kind for b in bodies)
    usage = None
    if include_usage:
        last = bodies.pop()
        assert last["choices"] == [] and last["usage"]["total_tokens"] > 0, last
        usage = last["usage"]
        assert all(b["usage"] is None for b in bodies)
    else:
        assert all("usage" not in b for b in bodies)
    *content, final = bodies
    assert all(len(b["choices"]) == 1 and b["choices"][0]["finish_reason"] is None for b in content)
    assert final["choices"][0]["finish_reason"] in ("stop", "length")
    if chat:
        deltas = [b["choices"][0]["delta"] for b in content] + [final["choices"][0]["delta"]]
        assert deltas[0].get("role") == "assistant" and all("role" not in d for d in deltas[1:])
        text = "".join(d.get("content") or "" for d in deltas)
        assert "content" not in deltas[-1] or not deltas[-1]["content"]
    else:
        text = "".join(b["choices"][0]["text"] for b in content + [final])
        assert final["choices"][0]["text"] == ""
    assert all(
        (b["choices"][0].get("text") or b["choices"][0].get("delta", {}).get("content")) for b in content[1:]
    )
    return {"text": text, "finish_reason": final["choices"][0]["finish_reason"], "usage": usage}


def metric(text: str, name: str, **labels: str) -> float:
    """One sample of a Prometheus exposition (``/metrics``), by its full name (``..._total``,
    ``..._count``) and the labels it must carry; 0.0 for a labelled series not yet created."""
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    return 0.0
