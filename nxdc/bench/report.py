"""Render benchmark results: a rich table for people, a PNG plot for people who would rather look."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console
from rich.table import Table

from nxdc.errors import UserInputError


def table(result: dict) -> Table:
    m = result["machine"]
    t = Table(
        title=f"nxdc bench — {m['cpu']}, {m['threads']} threads, read {m['read_bandwidth_gbs']:.0f} GB/s at start, "
        f"torch {m['torch']}"
    )
    cols = [
        "export",
        "B",
        "prompt",
        "TTFT ms",
        "ITL ms p50/90/99",
        "tok/s",
        "prefill tok/s",
        "e2e ms",
        "GB/s used/avail",
        "roofline (paired)",
        "RSS MiB",
    ]
    compare = any("transformers" in r for r in result["rows"])
    if compare:
        cols += ["HF tok/s", "tok/s ×HF", "TTFT ×HF"]
    for c in cols:
        t.add_column(c, justify="left" if c == "export" else "right", overflow="fold")
    for r in result["rows"]:
        itl = r["itl_ms"]
        cells = [
            Path(r["export"]).name,
            str(r["batch"]),
            str(r["prompt_tokens"]),
            f"{r['ttft_ms']:.0f}",
            f"{itl['p50']:.1f}/{itl['p90']:.1f}/{itl['p99']:.1f}",
            f"{r['decode_tokens_per_s']:.1f}",
            f"{r['prefill_tokens_per_s']:.0f}",
            f"{r['e2e_ms']:.0f}",
            f"{r['read_gbs_achieved']:.0f}/{r['read_bandwidth_gbs']:.0f}",
            f"{100 * r['fraction_of_read_roofline']:.0f}% ({100 * r['fraction_of_read_roofline_paired']:.0f}%)",
            f"{r['peak_rss_mib']:.0f}",
        ]
        if compare:
            h, ratio = r.get("transformers"), r.get("ratio_vs_transformers")
            cells += (
                [
                    f"{h['decode_tokens_per_s']:.1f}",
                    f"{ratio['decode_tokens_per_s']:.2f}×",
                    f"{ratio['ttft']:.2f}×",
                ]
                if h
                else ["-", "-", "-"]
            )
        t.add_row(*cells)
    return t


def print_table(result: dict, console: Console) -> None:
    """The table at its natural width when the output is a log or a pipe (rich would otherwise
    fold it into 80 columns of wrapped cells); a terminal keeps its own width."""
    t = table(result)
    if console.is_terminal:
        console.print(t)
    else:  # a table that is not expanded renders at its natural width, up to this
        Console(file=console.file, width=max(console.width, 400), highlight=False).print(t)


def plot(result: dict, path: Path) -> None:
    """Throughput vs batch size (one line per prompt length) and TTFT vs prompt length (one
    line per batch size)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UserInputError("--plot needs matplotlib: pip install matplotlib") from None
    rows = result["rows"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2))
    _panel(a, rows, "prompt_tokens", "prompt", "batch", "decode_tokens_per_s")
    a.set(xlabel="batch size", ylabel="decode tokens/s", title="Decode throughput")
    _panel(b, rows, "batch", "batch", "prompt_tokens", "ttft_ms")
    b.set(xlabel="prompt tokens", ylabel="time to first token (ms)", title="Latency vs prompt length")
    m = result["machine"]
    fig.suptitle(f"{m['cpu']} · {m['threads']} threads · torch {m['torch']}", fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _panel(ax, rows: list[dict], group: str, group_label: str, x: str, y: str) -> None:
    """One nxdc line (and a transformers line where compared) per value of ``group``."""
    for g in sorted({r[group] for r in rows}):
        rs = sorted((r for r in rows if r[group] == g), key=lambda r: r[x])
        ax.plot([r[x] for r in rs], [r[y] for r in rs], "o-", label=f"nxdc, {group_label} {g}")
        hf = [r for r in rs if "transformers" in r]
        if hf:
            ax.plot(
                [r[x] for r in hf],
                [r["transformers"][y] for r in hf],
                "s--",
                label=f"transformers, {group_label} {g}",
            )
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
