"""Real sizes: nxdc against llama.cpp at Llama-3.2-1B and Llama-3.1-8B shapes (random weights),
on the very same tensors, run alternately round after round (docs/performance.md, "Real sizes").

    .venv/bin/python bench/scale.py --llama-bin /tmp/lcp/build/bin [--shapes 1b,8b] [--rounds 3]
        [--formats int4,gguf-q4_k_m,int8,bf16,dtype-bf16] [--cleanup]

For each shape: writes a seeded random-weight checkpoint once (sharded bf16 safetensors, the
embedded SmolLM2 tokenizer, vocabulary 49152) under ``--work`` (default bench/exports/scale).
For each format: exports it with ``nxdc export`` (wall time and peak RSS of the process and its
compiler children), makes llama.cpp's GGUF of the same tensors (its own convert_hf_to_gguf.py to
BF16, then llama-quantize), then runs, per round, ``llama-batched-bench`` and ``nxdc bench`` one
after the other (each a fresh process; peak RSS from wait4): decode tok/s after a 128-token
prompt, prefill tok/s and TTFT(128) at batch 1 on ``--threads`` threads. nxdc's decode RSS is
the peak its bench measures from loading on, less the bench's own read-bandwidth buffer. Runs this host cannot hold (RAM or
disk) are skipped with a line saying so. Writes bench/results/<date>-scale-<host>.json and, with
``--docs``, the "Real sizes" table of docs/performance.md.

``--formats`` (nxdc's side ↔ llama.cpp's type):
  int4 ``--weights int4`` ↔ Q4_K_M · int4-sym ``--weights int4-sym`` ↔ Q4_0 ·
  gguf-q4_k_m the Q4_K_M GGUF kept as stored (``--weights auto``) ↔ Q4_K_M ·
  int4-a8 / gguf-q4_k_m-a8 the same two with ``--decode-matmul int8`` ↔ Q4_K_M ·
  int4-sym-a8 ``--weights int4-sym --decode-matmul int8`` ↔ Q4_0 ·
  int4-k-a8 ``--weights int4-k --decode-matmul int8`` ↔ Q4_K_M ·
  int8 ``--weights int8`` ↔ Q8_0 (int8-a8: with ``--decode-matmul int8``; int8-tiles /
  int8-tiles-a8: those with ``--prefill-matmul tiles-int8``) · bf16 ``--weights bf16`` ↔ BF16 · dtype-bf16 ``--dtype bf16`` ↔ BF16

llama.cpp is built as bench/llamacpp.py's docstring says (llama-batched-bench, llama-quantize); its
source tree (for the converter) is found from the build's CMakeCache.txt or given as --llama-src.
The converter also imports sentencepiece and protobuf, which nxdc does not need:
``.venv/bin/pip install sentencepiece protobuf`` once.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NXDC = [sys.executable, "-m", "nxdc.cli.main"]
GIB = 2**30

# Llama-3.2-1B and Llama-3.1-8B shapes with SmolLM2's vocabulary (its tokenizer ships with nxdc).
SHAPES = {
    "tiny": dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, tie_word_embeddings=True),
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, tie_word_embeddings=True),
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, tie_word_embeddings=False),
}
# name: (nxdc export flags, llama.cpp type, export from the llama.cpp GGUF instead of the checkpoint)
FORMATS = {
    "int4": (["--weights", "int4"], "Q4_K_M", False),
    "gguf-q4_k_m": (["--weights", "auto"], "Q4_K_M", True),
    "int4-sym": (["--weights", "int4-sym"], "Q4_0", False),
    # decode on int8 activations, as llama.cpp's own Q4_K_M decode runs (docs/weights.md)
    "int4-a8": (["--weights", "int4", "--decode-matmul", "int8"], "Q4_K_M", False),
    "gguf-q4_k_m-a8": (["--weights", "auto", "--decode-matmul", "int8"], "Q4_K_M", True),
    "int4-sym-a8": (["--weights", "int4-sym", "--decode-matmul", "int8"], "Q4_0", False),
    # two-level scales and mins, as Q4_K's (4.6 bits a weight where int4's fp16 ones take 5)
    "int4-k-a8": (["--weights", "int4-k", "--decode-matmul", "int8"], "Q4_K_M", False),
    "int8": (["--weights", "int8"], "Q8_0", False),
    "int8-a8": (["--weights", "int8", "--decode-matmul", "int8"], "Q8_0", False),
    # prompts on bf16 tiles too (docs/weights.md: --prefill-matmul tiles-int8)
    "int8-tiles": (["--weights", "int8", "--prefill-matmul", "tiles-int8"], "Q8_0", False),
    "int8-tiles-a8": (
        ["--weights", "int8", "--prefill-matmul", "tiles-int8", "--decode-matmul", "int8"],
        "Q8_0",
        False,
    ),
    "bf16": (["--weights", "bf16"], "BF16", False),
    "dtype-bf16": (["--dtype", "bf16"], "BF16", False),
}
BYTES_PER_WEIGHT = {"Q4_K_M": 0.6, "Q4_0": 0.5625, "Q8_0": 1.0625, "BF16": 2.0}


def hf_config(shape: str) -> dict:
    s = SHAPES[shape]
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "num_attention_heads": 32 if s["hidden_size"] >= 2048 else 4,
        "num_key_value_heads": 8 if s["hidden_size"] >= 2048 else 2,
        "vocab_size": 49152,
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "hidden_act": "silu",
        "torch_dtype": "bfloat16",
        "bos_token_id": 1,
        "eos_token_id": 2,
        **s,
    }


def tensor_shapes(cfg: dict) -> list[tuple[str, tuple[int, ...]]]:
    h, f, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    kv = h // cfg["num_attention_heads"] * cfg["num_key_value_heads"]
    out = [("model.embed_tokens.weight", (v, h))]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out += [(p + "input_layernorm.weight", (h,)), (p + "post_attention_layernorm.weight", (h,))]
        out += [
            (p + f"self_attn.{n}_proj.weight", s) for n, s in (("q", (h, h)), ("k", (kv, h)), ("v", (kv, h)))
        ]
        out += [(p + "self_attn.o_proj.weight", (h, h))]
        out += [(p + f"mlp.{n}_proj.weight", (f, h)) for n in ("gate", "up")] + [
            (p + "mlp.down_proj.weight", (h, f))
        ]
    out.append(("model.norm.weight", (h,)))
    if not cfg["tie_word_embeddings"]:
        out.append(("lm_head.weight", (v, h)))
    return out


def checkpoint(shape: str, work: Path) -> Path:
    """The shape's random bf16 checkpoint (seeded: the same tensors on every host), written once,
    shard by shard into a temporary folder renamed at the end."""
    import torch
    from safetensors.torch import save_file

    from nxdc.weights.sources import DEFAULT_MODEL, resolve

    out = work / f"llama-{shape}"
    if (out / "config.json").is_file():
        return out
    cfg = hf_config(shape)
    shapes = tensor_shapes(cfg)
    need = sum(2 * _numel(s) for _, s in shapes)
    _need_disk(work, need, f"the {shape} checkpoint")
    tmp = work / f".tmp-llama-{shape}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    shards, cur = [[]], 0
    for name, s in shapes:
        if cur and cur + 2 * _numel(s) > 2 * GIB:
            shards.append([])
            cur = 0
        shards[-1].append((name, s))
        cur += 2 * _numel(s)
    weight_map = {}
    for i, group in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = {}
        for name, s in group:
            g = torch.Generator().manual_seed(sum(map(ord, name)) * 7919 + len(name))
            t = torch.empty(s, dtype=torch.bfloat16)
            tensors[name] = t.fill_(1.0) if len(s) == 1 else t.normal_(0, 0.02, generator=g)
            weight_map[name] = fname
        save_file(tensors, str(tmp / fname), metadata={"format": "pt"})
    index = {"metadata": {"total_size": need}, "weight_map": weight_map}
    (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    resolve(DEFAULT_MODEL).save_tokenizer(tmp)
    (tmp / "config.json").write_text(json.dumps(cfg, indent=1))
    tmp.rename(out)
    return out


def _numel(s: tuple[int, ...]) -> int:
    n = 1
    for d in s:
        n *= d
    return n


def weights_bytes(shape: str, bytes_per_weight: float) -> float:
    return sum(_numel(s) for _, s in tensor_shapes(hf_config(shape))) * bytes_per_weight


def _need_disk(where: Path, nbytes: float, what: str) -> None:
    where.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(where).free
    if free < nbytes + 2 * GIB:
        raise Skip(f"{what} needs {nbytes / GIB:.1f} GiB of disk, {free / GIB:.1f} GiB free")


def _need_ram(nbytes: float, what: str) -> None:
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if nbytes > total - GIB:
        raise Skip(f"{what} needs about {nbytes / GIB:.1f} GiB of RAM; this host has {total / GIB:.1f} GiB")


class Skip(Exception):
    """A run this host cannot hold."""


def run_measured(argv: list[str], env: dict | None = None) -> tuple[str, float, float]:
    """Run ``argv`` to completion: (stdout, wall seconds, peak RSS in MiB of the process or its
    largest waited-for descendant, from wait4)."""
    t = time.perf_counter()
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        p = subprocess.Popen(argv, stdout=out, stderr=err, text=True, env=env)
        _, status, usage = os.wait4(p.pid, 0)  # (Popen.wait would reap it without the usage)
        p.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(argv[:4])} ... exited {p.returncode}: {stderr.strip()[-2000:]}")
    return stdout, time.perf_counter() - t, usage.ru_maxrss / 1024


def llama_ggufs(args, ckpt: Path, shape: str, ltype: str) -> Path:
    """llama.cpp's GGUF of the checkpoint: its converter to BF16, then llama-quantize."""
    work = args.work
    bf16 = work / f"llama-{shape}-BF16.gguf"
    if not bf16.exists():
        _need_disk(work, weights_bytes(shape, 2), f"{shape} BF16 GGUF")
        tmp = bf16.with_suffix(".tmp")
        conv = [sys.executable, str(args.llama_src / "convert_hf_to_gguf.py"), str(ckpt)]
        run_measured([*conv, "--outtype", "bf16", "--outfile", str(tmp)])
        tmp.rename(bf16)
    if ltype == "BF16":
        return bf16
    out = work / f"llama-{shape}-{ltype}.gguf"
    if not out.exists():
        _need_disk(work, weights_bytes(shape, BYTES_PER_WEIGHT[ltype]), f"{shape} {ltype} GGUF")
        tmp = out.with_suffix(".tmp")
        run_measured([str(args.llama_bin / "llama-quantize"), str(bf16), str(tmp), ltype, str(args.threads)])
        tmp.rename(out)
    return out


def nxdc_export(args, src: Path, shape: str, fmt: str) -> tuple[Path, dict]:
    flags = FORMATS[fmt][0]
    out = args.work / f"nxdc-{shape}-{fmt}"
    argv = [*NXDC, "export", str(src), "-o", str(out), *flags, "--sequence-length", "256"]
    argv += ["--context-buckets", "128", "--decode-buckets", "256", "--cache-dir", str(args.work / "cache")]
    _, wall, rss = run_measured([*argv, "--json", "-q"])
    return out, {"export_s": wall, "export_peak_rss_mib": rss}


def llama_run(args, gguf: Path) -> dict:
    cmd = [str(args.llama_bin / "llama-batched-bench"), "-m", str(gguf), "-c", "512"]
    cmd += ["-npp", str(args.prompt_length), "-ntg", str(args.new_tokens), "-npl", "1"]
    cmd += ["-t", str(args.threads), "--output-format", "jsonl"]
    out, _, rss = run_measured(cmd)
    row = next(json.loads(line) for line in out.splitlines() if line.startswith("{"))
    return {
        "decode_tokens_per_s": float(row["speed_tg"]),
        "prefill_tokens_per_s": float(row["speed_pp"]),
        "ttft_ms": float(row["t_pp"]) * 1000,
        "peak_rss_mib": rss,
    }


def nxdc_run(args, export: Path) -> dict:
    cmd = [*NXDC, "bench", str(export), "--batch-sizes", "1", "--prompt-lengths", str(args.prompt_length)]
    cmd += [
        "--new-tokens",
        str(args.new_tokens),
        "--runs",
        "1",
        "--warmup",
        "1",
        "--threads",
        str(args.threads),
    ]
    out, _, _ = run_measured([*cmd, "--json", "-", "-q"])
    row = json.loads(out)["rows"][0]
    keys = ("decode_tokens_per_s", "prefill_tokens_per_s", "ttft_ms", "read_bandwidth_gbs")
    # the peak from loading on, less the buffer the bench's bandwidth samples keep
    return {k: row[k] for k in keys} | {"peak_rss_mib": row["peak_rss_mib"] - row["read_buffer_mib"]}


def bench_format(args, shape: str, ckpt: Path, fmt: str) -> dict:
    flags, ltype, from_gguf = FORMATS[fmt]
    nbytes = weights_bytes(shape, BYTES_PER_WEIGHT.get(ltype, 2))
    _need_ram(nbytes + 2 * GIB, f"{shape} {fmt}")
    gguf = llama_ggufs(args, ckpt, shape, ltype)
    _need_disk(args.work, nbytes, f"the {shape} {fmt} export")
    export, res = nxdc_export(args, gguf if from_gguf else ckpt, shape, fmt)
    res |= {
        "llama_cpp_type": ltype,
        "nxdc_flags": flags,
        "weights_file_bytes": _dir_bytes(export / "weights"),
    }
    res["llama_cpp_gguf_bytes"] = gguf.stat().st_size
    runs = {"nxdc": [], "llama.cpp": []}
    for r in range(args.rounds):
        order = (("nxdc", nxdc_run, export), ("llama.cpp", llama_run, gguf))
        for who, fn, what in order if r % 2 == 0 else order[::-1]:
            runs[who].append(fn(args, what))
        print(f"  {shape} {fmt} round {r + 1}/{args.rounds}: " + _line(runs), file=sys.stderr, flush=True)
    res["runs"] = runs
    if args.cleanup:
        shutil.rmtree(export, ignore_errors=True)
        if ltype != "BF16":
            gguf.unlink(missing_ok=True)
    return res


def _dir_bytes(d: Path) -> int:
    return sum(f.stat().st_size for f in d.rglob("*") if f.is_file())


def _line(runs: dict) -> str:
    n, ll = runs["nxdc"][-1], runs["llama.cpp"][-1]
    return (
        f"decode {n['decode_tokens_per_s']:.2f} / {ll['decode_tokens_per_s']:.2f} tok/s, "
        f"TTFT {n['ttft_ms']:.0f} / {ll['ttft_ms']:.0f} ms (nxdc / llama.cpp)"
    )


def summary(res: dict) -> dict:
    """Medians per side, and nxdc ÷ llama.cpp per round then the median (drift cancels in a round)."""
    med = statistics.median
    n, ll = res["runs"]["nxdc"], res["runs"]["llama.cpp"]
    out = {who: {k: med(r[k] for r in rs) for k in rs[0]} for who, rs in res["runs"].items()}
    out["decode_ratio"] = med(
        a["decode_tokens_per_s"] / b["decode_tokens_per_s"] for a, b in zip(n, ll, strict=True)
    )
    out["ttft_ratio"] = med(a["ttft_ms"] / b["ttft_ms"] for a, b in zip(n, ll, strict=True))
    return out


def table(results: dict) -> str:
    lines = [
        "| shape | nxdc | llama.cpp | decode tok/s nxdc / llama.cpp | ÷ | TTFT(128) ms nxdc / llama.cpp | ÷ "
        "| decode RSS GiB nxdc / llama.cpp (weights) | export s / peak GiB |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for shape, fmts in results.items():
        for fmt, res in fmts.items():
            if "skipped" in res:
                lines.append(f"| {shape} | {fmt} | | skipped: {res['skipped']} | | | | | |")
                continue
            s = summary(res)
            n, ll = s["nxdc"], s["llama.cpp"]
            lines.append(
                f"| {shape} | `{' '.join(res['nxdc_flags'])}` | {res['llama_cpp_type']} "
                f"| {n['decode_tokens_per_s']:.2f} / {ll['decode_tokens_per_s']:.2f} | {s['decode_ratio']:.2f}× "
                f"| {n['ttft_ms']:.0f} / {ll['ttft_ms']:.0f} | {s['ttft_ratio']:.2f}× "
                f"| {n['peak_rss_mib'] / 1024:.1f} / {ll['peak_rss_mib'] / 1024:.1f} ({res['weights_file_bytes'] / GIB:.1f}) "
                f"| {res['export_s']:.0f} / {res['export_peak_rss_mib'] / 1024:.1f} |"
            )
    return "\n".join(lines)


def write_docs(md: str, meta: str) -> None:
    """Replace the table between the markers of docs/performance.md's "Real sizes" section."""
    doc = ROOT / "docs" / "performance.md"
    text = doc.read_text()
    begin, end = "<!-- scale:begin -->", "<!-- scale:end -->"
    if begin not in text:
        text += f"\n## Real sizes\n\n{begin}\n{end}\n"
    head, rest = text.split(begin, 1)
    tail = rest.split(end, 1)[1]
    doc.write_text(f"{head}{begin}\n{meta}\n\n{md}\n{end}{tail}")


def find_llama_src(bin_dir: Path) -> Path | None:
    for cache in (bin_dir.parent / "CMakeCache.txt", bin_dir / "CMakeCache.txt"):
        if cache.is_file():
            for line in cache.read_text().splitlines():
                if line.startswith("CMAKE_HOME_DIRECTORY:INTERNAL="):
                    return Path(line.split("=", 1)[1])
    return None


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--llama-bin", type=Path, help="llama-batched-bench and llama-quantize (required to run)")
    ap.add_argument("--llama-src", type=Path, help="llama.cpp source tree (convert_hf_to_gguf.py)")
    ap.add_argument("--shapes", default="1b,8b", help=f"of {', '.join(SHAPES)}")
    ap.add_argument(
        "--formats", default="int4,gguf-q4_k_m,int8,bf16,dtype-bf16", help=f"of {', '.join(FORMATS)}"
    )
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompt-length", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--work", type=Path, default=ROOT / "bench" / "exports" / "scale")
    ap.add_argument(
        "--cleanup", action="store_true", help="delete each format's export and GGUF after its rounds"
    )
    ap.add_argument("--docs", action="store_true", help="write the table into docs/performance.md")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--render", type=Path, nargs="+", help="only write docs from these result files")
    return ap.parse_args()


def main() -> None:
    args = parse_args()
    if args.render:
        reports = [json.loads(f.read_text()) for f in args.render]
        results: dict[str, dict] = {}
        for rep in reports:
            for shape, by_format in rep["results"].items():
                results.setdefault(shape, {}).update(by_format)
        write_docs(table(results), _meta(reports, [f.resolve().relative_to(ROOT) for f in args.render]))
        return
    if args.llama_bin is None:
        sys.exit("error: --llama-bin is required (or --render)")
    args.llama_src = args.llama_src or find_llama_src(args.llama_bin)
    shapes, fmts = args.shapes.split(","), args.formats.split(",")
    bad = [s for s in shapes if s not in SHAPES] + [f for f in fmts if f not in FORMATS]
    if bad:
        sys.exit(f"error: unknown shape or format {', '.join(bad)}")
    tools = [args.llama_bin / "llama-batched-bench", args.llama_bin / "llama-quantize"]
    tools.append((args.llama_src or Path("?")) / "convert_hf_to_gguf.py")
    missing = [str(t) for t in tools if not t.is_file()]
    if missing:
        sys.exit(
            f"error: missing {', '.join(missing)}: build llama.cpp as bench/llamacpp.py's docstring says"
        )
    host = platform.node() or "host"
    args.out = args.out or ROOT / "bench" / "results" / f"{datetime.date.today()}-scale-{host}.json"
    results: dict[str, dict] = {}
    for shape in shapes:
        results[shape] = {}
        try:
            ckpt = checkpoint(shape, args.work)
        except Skip as e:
            print(f"skipped {shape}: {e}", file=sys.stderr)
            results[shape] = {f: {"skipped": str(e)} for f in fmts}
            continue
        for fmt in fmts:
            try:
                results[shape][fmt] = bench_format(args, shape, ckpt, fmt)
            except Skip as e:
                print(f"skipped {shape} {fmt}: {e}", file=sys.stderr)
                results[shape][fmt] = {"skipped": str(e)}
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(_report(args, results), indent=1))  # after every format
    md = table(results)
    print(md)
    if args.docs:
        write_docs(md, _meta([_report(args, results)], [args.out.resolve().relative_to(ROOT)]))


def _meta(reports: list[dict], files: list) -> str:
    r = reports[0]
    rounds = ", ".join(
        f"{s} {rep['rounds']} (read bandwidth {rep['read_bandwidth_gbs']} GB/s)"
        for rep in reports
        for s in rep["results"]
    )
    return (
        f"{r['cpu']}, {r['threads']} threads; batch 1, prompt {r['prompt_length']}, {r['new_tokens']} new "
        f"tokens; rounds alternated, per result file (a later file's rows replace an earlier's): {rounds}; "
        f"{r['llama_cpp_version']}. `bench/scale.py`; {', '.join(map(str, files))}."
    )


def _report(args, results: dict) -> dict:
    from nxdc.bench.machine import machine_info

    if not hasattr(args, "_machine"):
        version = subprocess.run(
            [str(args.llama_bin / "llama-batched-bench"), "--version"], capture_output=True, text=True
        )
        args._machine = machine_info(args.threads) | {
            "llama_cpp_version": (version.stdout + version.stderr).strip().splitlines()[0]
        }
    return {
        **args._machine,
        "rounds": args.rounds,
        "prompt_length": args.prompt_length,
        "new_tokens": args.new_tokens,
        "shapes": {s: hf_config(s) for s in results},
        "results": results,
        "summary": {s: {f: summary(r) for f, r in fr.items() if "runs" in r} for s, fr in results.items()},
    }


if __name__ == "__main__":
    main()
