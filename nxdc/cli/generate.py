"""`nxdc generate EXPORT --prompt ...`."""

from __future__ import annotations

import sys
from pathlib import Path

import typer

from nxdc.cli.common import JSON, QUIET, VERBOSE, cli_errors, err_console, print_json
from nxdc.errors import UserInputError


@cli_errors
def generate(
    export_dir: Path = typer.Argument(..., help="Directory written by `nxdc export`."),
    prompt: list[str] = typer.Option(None, "-p", "--prompt", help="Prompt text; repeat for a batch."),
    max_new_tokens: int = typer.Option(64, "-n", "--max-new-tokens"),
    do_sample: bool = typer.Option(False, "--do-sample", help="Sample instead of greedy decoding."),
    temperature: float = typer.Option(1.0, "--temperature"),
    top_k: int = typer.Option(0, "--top-k", help="0 = off."),
    top_p: float = typer.Option(1.0, "--top-p", help="1.0 = off."),
    seed: int = typer.Option(None, "--seed", help="Seed for reproducible sampling."),
    stop: list[str] = typer.Option(None, "--stop", help="Stop string; repeatable."),
    chat: bool = typer.Option(False, "--chat", help="Apply the tokenizer's chat template."),
    stream: bool = typer.Option(False, "--stream", help="Print tokens as they come (one prompt)."),
    threads: int = typer.Option(None, "--threads", help="CPU threads. \\[default: cores available]"),
    draft: Path = typer.Option(
        None, "--draft", help="Speculative decoding with this draft export (same tokenizer, --tp 1)."
    ),
    prompt_lookup: int = typer.Option(
        None,
        "--prompt-lookup",
        help="Speculative decoding with draft tokens from n-gram matches in the text (max n-gram N).",
    ),
    speculation_length: int = typer.Option(
        None, "--speculation-length", help="Draft tokens per step. \\[default: the export's K]"
    ),
    json_out: bool = JSON,
    quiet: bool = QUIET,
    verbose: bool = VERBOSE,
) -> None:
    """Generate text from an export directory (no recompilation). Exports made with --tp N run
    N processes (started here; or by torchrun across machines)."""
    import nxdc
    from nxdc.api.model import GenerateOptions
    from nxdc.runtime.threads import parse_threads
    from nxdc.runtime.workers import external_rank, follow

    prompts = list(prompt or [])
    if not prompts:
        raise UserInputError("give at least one --prompt")
    if stream and len(prompts) > 1:
        raise UserInputError("--stream takes a single --prompt")
    if threads is not None:
        parse_threads(threads)
    opts = GenerateOptions.pick(locals())  # the flags named as its fields, checked
    if external_rank():  # a non-zero rank started by torchrun: compute only, rank 0 prints
        follow(export_dir, threads or 1)
        return
    with nxdc.load(export_dir, threads=threads) as llm:  # checks the manifest and versions first
        if stream and not json_out:
            done = _stream(llm, prompts[0], opts)
        else:
            done = llm.generate(prompts, **vars(opts))
        _show(llm, done, json_out, quiet, stream)


def _stream(llm, prompt: str, opts) -> list:
    pieces = llm.stream(prompt, **vars(opts))
    for piece in pieces:
        sys.stdout.write(piece)
        sys.stdout.flush()
    sys.stdout.write("\n")
    return [pieces.completion]


def _show(llm, done, json_out: bool, quiet: bool, streamed: bool) -> None:
    if json_out:
        print_json({"results": [c.to_dict() for c in done], "stats": done[0].batch_stats})
        return
    if not streamed:
        for i, c in enumerate(done):
            if len(done) > 1 and not quiet:
                typer.echo(f"--- [{i}] {c.prompt!r}")
            typer.echo(c.text)
    if not quiet:
        st = done[0].batch_stats
        err_console.print(
            f"[dim]{st['new_tokens']} new tokens · TTFT {st['ttft_s'] * 1000:.0f} ms · "
            f"decode {st['decode_tokens_per_s']:.1f} tok/s · {llm.threads} threads[/]"
        )
        full = sum(c.stop_reason == "max_seq" for c in done)
        if full:
            which = "" if len(done) == 1 else f" ({full} of {len(done)} prompts)"
            err_console.print(
                f"[yellow]note:[/] stopped at the export's sequence length, {llm.sequence_length} tokens "
                f"(prompt + new){which}; export with a larger --sequence-length for more",
                soft_wrap=True,
            )
        if "speculation" in st:
            sp = st["speculation"]
            err_console.print(
                f"[dim]speculation ({sp['mode']}, k {sp['speculation_length']}): "
                f"{sp['accepted']}/{sp['proposed']} draft tokens accepted "
                f"({sp['acceptance_rate']:.0%}), {sp['tokens_per_call']:.2f} tokens per target call[/]"
            )
