"""`nxdc generate EXPORT --prompt ...`."""

from __future__ import annotations

import sys
from pathlib import Path

import typer

from nxdc.cli.common import cli_errors, err_console, print_json
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
    threads: int = typer.Option(None, "--threads", help="CPU threads. [default: cores available]"),
    json_out: bool = typer.Option(False, "--json", help="Print results and stats as JSON."),
    quiet: bool = typer.Option(False, "-q", "--quiet", help="Only the generated text."),
    verbose: bool = typer.Option(False, "-v", "--verbose", help="Tracebacks on errors."),
) -> None:
    """Generate text from an export directory (no recompilation). Exports made with --tp N run
    N processes (started here; or by torchrun across machines)."""
    from nxdc.generation.sampling import SamplingParams
    from nxdc.runtime.threads import parse_threads
    from nxdc.runtime.workers import external_rank, open_session, serve

    prompts = list(prompt or [])
    if not prompts:
        raise UserInputError("give at least one --prompt")
    if stream and len(prompts) > 1:
        raise UserInputError("--stream takes a single --prompt")
    if threads is not None:
        parse_threads(threads)
    sampling = SamplingParams(do_sample, temperature, top_k, top_p, seed).validate()
    if external_rank():  # a non-zero rank started by torchrun: compute only, rank 0 prints
        serve(export_dir, threads or 1)
        return
    session = open_session(export_dir, threads=threads)  # checks the manifest and versions first
    try:
        _generate(session, export_dir, prompts, max_new_tokens, sampling, stop, chat, stream, json_out, quiet)
    finally:
        session.close()


def _generate(session, export_dir, prompts, max_new_tokens, sampling, stop, chat, stream, json_out, quiet):
    from nxdc.generation.loop import generate as run

    tokenizer = load_tokenizer(export_dir)

    def on_text(t: str) -> None:
        sys.stdout.write(t)
        sys.stdout.flush()

    res = run(
        session,
        tokenizer,
        prompts,
        max_new_tokens,
        sampling,
        list(stop or []),
        chat,
        on_text=on_text if stream and not json_out else None,
    )
    if json_out:
        print_json(res.to_dict())
        return
    if stream:
        sys.stdout.write("\n")
    else:
        for i, s in enumerate(res.sequences):
            if len(res.sequences) > 1 and not quiet:
                typer.echo(f"--- [{i}] {s.prompt!r}")
            typer.echo(s.text)
    if not quiet:
        st = res.to_dict()["stats"]
        err_console.print(
            f"[dim]{st['new_tokens']} new tokens · TTFT {st['ttft_s'] * 1000:.0f} ms · "
            f"decode {st['decode_tokens_per_s']:.1f} tok/s · {session.threads} threads[/]"
        )


def load_tokenizer(export_dir: Path):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(export_dir))
    except Exception as e:
        raise UserInputError(f"{export_dir}: cannot load the tokenizer ({e})") from e
