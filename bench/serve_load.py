"""`nxdc serve` under load, side by side with llama.cpp's `llama-server` on the same weights
(docs/serve.md). Both servers run on this machine, on loopback, and are driven alternately,
round after round, by the same bounded load generator, so that the host's drift hits both alike.

llama.cpp is not a dependency of nxdc. Build its llama-server and llama-quantize once from the
llama.cpp that the llama-cpp-python source package vendors (PyPI only), as bench/llamacpp.py says,
with `--target llama-server llama-quantize`, then:

    .venv/bin/python bench/serve_load.py --llama-bin /tmp/lcp/build/bin [--weights fp32] [--rounds 3]

What it measures, per server, workload (prompt / output tokens: 128/128 and 512/64) and
concurrency (1, 2, 4, 8, 16 clients, each sending its next request when the last one ends; at
least 8 x concurrency requests): TTFT, time per output token (TPOT: (end - first token) /
(tokens - 1)), inter-token latency p50/p90/p99, end-to-end latency, requests/s, output tokens/s
and errors by status. Every request streams, asks for exactly its output length
(`ignore_eos`, temperature 0) and sends its prompt as token ids (both servers read the same
GGUF tokenizer), each prompt a different slice of a text, so no server reuses another request's
prompt. Then a head-of-line case (7 streams decoding while a 1,000-token prompt arrives every
5 s: the 7 streams' ITL p99) and, for nxdc, a soak of 2,000 short requests with the growth of
the server processes' anonymous memory (RssAnon). Writes docs/bench-serve.json and prints
Markdown tables.

nxdc serves configs/smollm2-135m-serve.toml's export (with `--weights`, its format);
llama-server the GGUF llama-quantize makes of the same weights (F32 / F16 / BF16 / Q8_0), with
`-np 8 -t 2` and 1,024 positions per slot."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
TEXT = ROOT / "README.md"  # prompts are slices of this text's tokens
SLOTS, CTX = 8, 1024


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


class Load:
    """One server's HTTP endpoint and the bookkeeping of its requests."""

    def __init__(self, url: str, model: str):
        self.url, self.model = url, model

    async def one(self, session, prompt: list[int], out: int) -> dict:
        import aiohttp

        body = {
            "model": self.model,
            "prompt": prompt,
            "max_tokens": out,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        t0 = time.perf_counter()
        stamps, usage, status = [], None, 200
        try:
            async with session.post(self.url + "/v1/completions", json=body) as r:
                status = r.status
                if r.status != 200:
                    await r.read()
                    return {"status": r.status}
                buf = b""
                async for data in r.content.iter_any():
                    now = time.perf_counter()
                    buf += data
                    while b"\n\n" in buf:
                        event, buf = buf.split(b"\n\n", 1)
                        if not event.startswith(b"data: ") or event == b"data: [DONE]":
                            continue
                        j = json.loads(event[6:])
                        if j.get("usage"):
                            usage = j["usage"]
                        if j.get("choices") and j["choices"][0].get("text"):
                            stamps.append(now)
        except aiohttp.ClientError as e:
            return {"status": f"error: {type(e).__name__}"}
        end = time.perf_counter()
        n = (usage or {}).get("completion_tokens") or len(stamps)
        if not stamps:
            return {"status": "no tokens"}
        return {
            "status": status,
            "ttft": stamps[0] - t0,
            "e2e": end - t0,
            "tokens": n,
            "tpot": (stamps[-1] - stamps[0]) / (n - 1) if n > 1 else 0.0,
            "itl": [b - a for a, b in zip(stamps[:-1], stamps[1:], strict=True)],
        }


async def closed_loop(load: Load, prompts, out: int, concurrency: int, total: int) -> dict:
    """``concurrency`` clients, each sending its next request when its last one ends."""
    import aiohttp

    queue = list(prompts[:total])
    results = []

    async def client(session):
        while queue:
            results.append(await load.one(session, queue.pop(), out))

    conn = aiohttp.TCPConnector(limit=0, force_close=True)  # a connection per request, for both servers
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=600)) as s:
        t0 = time.perf_counter()
        await asyncio.gather(*(client(s) for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    return summarize(results, wall)


def summarize(results: list[dict], wall: float) -> dict:
    ok = [r for r in results if r["status"] == 200]
    errors: dict[str, int] = {}
    for r in results:
        if r["status"] != 200:
            errors[str(r["status"])] = errors.get(str(r["status"]), 0) + 1
    itl = [x for r in ok for x in r["itl"]]
    med = lambda k: statistics.median(r[k] for r in ok) if ok else float("nan")  # noqa: E731
    return {
        "requests": len(results),
        "errors": errors,
        "wall_s": wall,
        "requests_per_s": len(ok) / wall,
        "output_tokens_per_s": sum(r["tokens"] for r in ok) / wall,
        "ttft_ms": {"p50": med("ttft") * 1e3, "p90": pct([r["ttft"] for r in ok], 90) * 1e3},
        "tpot_ms": {"p50": med("tpot") * 1e3, "p90": pct([r["tpot"] for r in ok], 90) * 1e3},
        "itl_ms": {q: pct(itl, int(q[1:])) * 1e3 for q in ("p50", "p90", "p99")},
        "e2e_ms": {"p50": med("e2e") * 1e3},
    }


async def head_of_line(load: Load, prompts, long_prompts, seconds: float) -> dict:
    """7 closed-loop streams (128 prompt / 256 output tokens) while a 1,000-token prompt (16
    output tokens) arrives every 5 s; the ITL of the 7 streams."""
    import aiohttp

    stop_at = time.perf_counter() + seconds
    streams, longs = [], []
    pool = list(prompts)

    async def stream(session):
        while time.perf_counter() < stop_at:
            streams.append(await load.one(session, pool.pop(), 256))

    async def arrivals(session):
        tasks = []
        for p in long_prompts:
            await asyncio.sleep(5)
            if time.perf_counter() > stop_at:
                break
            tasks.append(asyncio.create_task(load.one(session, p, 16)))
        longs.extend(await asyncio.gather(*tasks))

    conn = aiohttp.TCPConnector(limit=0, force_close=True)  # a connection per request, for both servers
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=600)) as s:
        await asyncio.gather(*(stream(s) for _ in range(7)), arrivals(s))
    itl = [x for r in streams if r["status"] == 200 for x in r["itl"]]
    ok = [r for r in longs if r["status"] == 200]
    return {
        "stream_itl_ms": {q: pct(itl, int(q[1:])) * 1e3 for q in ("p50", "p90", "p99")},
        "stream_itl_max_ms": max(itl) * 1e3 if itl else None,
        "long_prompts": len(longs),
        "long_ttft_ms_p50": statistics.median(r["ttft"] for r in ok) * 1e3 if ok else None,
        "errors": sum(r["status"] != 200 for r in streams + longs),
    }


def rss_anon_kib(pids: list[int]) -> int:
    total = 0
    for pid in pids:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("RssAnon:"):
                total += int(line.split()[1])
    return total


def descendants(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
    kids = [int(p) for p in out]
    return [pid] + [d for k in kids for d in descendants(k)]


def wait_ready(url: str, proc: subprocess.Popen, timeout: float = 300) -> None:
    import urllib.request

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            sys.exit(f"error: server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    sys.exit(f"error: {url} not ready in {timeout} s")


def prompt_pool(seed: int, length: int, count: int, ids: list[int]) -> list[list[int]]:
    rng = random.Random(seed)
    return [ids[(o := rng.randrange(len(ids) - length)) : o + length] for _ in range(count)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--llama-bin", type=Path, required=True, help="directory with llama-server, llama-quantize"
    )
    ap.add_argument("--weights", default="fp32", choices=["fp32", "fp16", "bf16", "int8"])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--concurrency", default="1,2,4,8,16")
    ap.add_argument("--workloads", default="128/128,512/64")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--hol-seconds", type=float, default=30.0)
    ap.add_argument("--soak", type=int, default=2000)
    ap.add_argument("--nxdc-args", default="", help="more `nxdc serve` options, e.g. '--step-budget 3'")
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "bench-serve.json")
    args = ap.parse_args()
    for tool in ("llama-server", "llama-quantize"):
        if not (args.llama_bin / tool).is_file():
            sys.exit(f"error: no {tool} in {args.llama_bin}: build it as this script's docstring says")
    from llamacpp import FORMATS, gguf_for

    from nxdc.pipeline import run_export
    from nxdc.plan import ExportOptions, load_preset
    from nxdc.serve.text import TextTokenizer
    from nxdc.weights.sources import embedded_path

    gguf = gguf_for(args.llama_bin, embedded_path("smollm2-135m"), FORMATS[args.weights])
    preset = load_preset(ROOT / "configs" / "smollm2-135m-serve.toml")
    preset.pop("model", None)
    export = ROOT / "bench" / "exports" / f"serve-{args.weights}"
    weights = None if args.weights == "fp32" else args.weights
    run_export("smollm2-135m", export, ExportOptions(**preset, weights=weights))
    ids = TextTokenizer(export).encode(TEXT.read_text() * 4)

    env = {**os.environ, "NXDC_THREADS": str(args.threads)}
    servers = {
        "nxdc": subprocess.Popen(
            [
                sys.executable,
                "-m",
                "nxdc.cli.main",
                "serve",
                str(export),
                "--port",
                "8431",
                "--quiet",
                "--served-model-name",
                "smollm2",
                "--threads",
                str(args.threads),
                "--max-queue",
                "256",
                *args.nxdc_args.split(),
            ],
            env=env,
            stdout=subprocess.DEVNULL,
        ),  # fmt: skip
        "llama.cpp": subprocess.Popen(
            [
                str(args.llama_bin / "llama-server"),
                "-m",
                str(gguf),
                "--host",
                "127.0.0.1",
                "--port",
                "8432",
                "-np",
                str(SLOTS),
                "-t",
                str(args.threads),
                "-c",
                str(SLOTS * CTX),
                "-a",
                "smollm2",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        ),  # fmt: skip
    }
    loads = {
        "nxdc": Load("http://127.0.0.1:8431", "smollm2"),
        "llama.cpp": Load("http://127.0.0.1:8432", "smollm2"),
    }
    try:
        for name, proc in servers.items():
            wait_ready(loads[name].url, proc)
        levels = [int(c) for c in args.concurrency.split(",")]
        workloads = [tuple(int(x) for x in w.split("/")) for w in args.workloads.split(",")]
        runs: dict[str, dict[str, list]] = {}
        for r in range(args.rounds):
            order = list(loads) if r % 2 == 0 else list(reversed(loads))
            for p_len, out in workloads:
                for c in levels:
                    key = f"{p_len}/{out} c{c}"
                    for name in order:
                        pool = prompt_pool(1000 * r + c, p_len, max(8 * c, 16), ids)
                        asyncio.run(closed_loop(loads[name], pool[:c], out, c, c))  # warm-up
                        res = asyncio.run(closed_loop(loads[name], pool, out, c, max(8 * c, 16)))
                        runs.setdefault(key, {}).setdefault(name, []).append(res)
                        print(
                            f"round {r + 1} {key} {name}: {res['output_tokens_per_s']:.1f} tok/s, "
                            f"TTFT p50 {res['ttft_ms']['p50']:.0f} ms, TPOT p50 {res['tpot_ms']['p50']:.1f} ms, "
                            f"errors {res['errors']}",
                            file=sys.stderr,
                        )
        hol = {}
        for name in loads:
            hol[name] = asyncio.run(
                head_of_line(
                    loads[name],
                    prompt_pool(7, 128, 400, ids),
                    prompt_pool(8, 1000, 20, ids),
                    args.hol_seconds,
                )
            )
            print(f"head-of-line {name}: {hol[name]}", file=sys.stderr)
        soak = None
        if args.soak:
            pids = descendants(servers["nxdc"].pid)
            asyncio.run(closed_loop(loads["nxdc"], prompt_pool(9, 32, 64, ids), 16, 8, 64))  # warm
            before = rss_anon_kib(pids)
            res = asyncio.run(
                closed_loop(loads["nxdc"], prompt_pool(10, 32, args.soak, ids), 16, 8, args.soak)
            )
            after = rss_anon_kib(pids)
            soak = {"requests": args.soak, "errors": res["errors"], "rss_anon_mib_before": before / 1024,
                    "rss_anon_growth_mib": (after - before) / 1024}  # fmt: skip
            print(f"soak: {soak}", file=sys.stderr)
    finally:
        for proc in servers.values():
            proc.send_signal(signal.SIGTERM)
        for proc in servers.values():
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
    version = subprocess.run(
        [str(args.llama_bin / "llama-server"), "--version"], capture_output=True, text=True
    )
    from nxdc.bench.machine import machine_info

    result = {
        "weights": args.weights,
        "llama_cpp_type": FORMATS[args.weights],
        "llama_cpp_version": (version.stdout + version.stderr).strip().splitlines()[0],
        "threads": args.threads,
        "nxdc_args": args.nxdc_args,
        "rounds": args.rounds,
        "machine": machine_info(args.threads),
        "runs": runs,
        "head_of_line": hol,
        "soak": soak,
    }
    args.out.write_text(json.dumps(result, indent=1))
    report(result)


def report(result: dict) -> None:
    med = statistics.median
    print(
        "| workload | clients | output tok/s nxdc / llama.cpp | TTFT p50 ms | TPOT p50 ms | ITL p99 ms | errors |"
    )
    print("|---|---|---|---|---|---|---|")
    for key, by in result["runs"].items():
        a, b = by["nxdc"], by["llama.cpp"]

        def m(runs, f):
            return med(f(x) for x in runs)

        ratio = med(x["output_tokens_per_s"] / y["output_tokens_per_s"] for x, y in zip(a, b, strict=True))
        w, c = key.split(" ")
        print(
            f"| {w} | {c[1:]} | {m(a, lambda x: x['output_tokens_per_s']):.0f} / {m(b, lambda x: x['output_tokens_per_s']):.0f} ({ratio:.2f}×) "
            f"| {m(a, lambda x: x['ttft_ms']['p50']):.0f} / {m(b, lambda x: x['ttft_ms']['p50']):.0f} "
            f"| {m(a, lambda x: x['tpot_ms']['p50']):.1f} / {m(b, lambda x: x['tpot_ms']['p50']):.1f} "
            f"| {m(a, lambda x: x['itl_ms']['p99']):.0f} / {m(b, lambda x: x['itl_ms']['p99']):.0f} "
            f"| {sum(sum(x['errors'].values()) for x in a)} / {sum(sum(x['errors'].values()) for x in b)} |"
        )
    hol = result["head_of_line"]
    print(
        f"\nhead-of-line (7 streams, a 1,000-token prompt every 5 s): stream ITL p99 nxdc "
        f"{hol['nxdc']['stream_itl_ms']['p99']:.0f} ms, llama.cpp {hol['llama.cpp']['stream_itl_ms']['p99']:.0f} ms"
    )
    if result["soak"]:
        s = result["soak"]
        print(
            f"soak: {s['requests']} requests, errors {s['errors']}, RssAnon growth {s['rss_anon_growth_mib']:.1f} MiB"
        )


if __name__ == "__main__":
    main()
