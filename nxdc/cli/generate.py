"""`nxdc generate EXPORT --prompt ...`."""

from __future__ import annotations

import sys
from pathlib import Path

import typer

from nxdc.cli.common import JSON, QUIET, VERBOSE, cli_errors, err_console, print_json
from nxdc.errors import UserInputError
from nxdc.runtime.tokenizer import load_tokenizer


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
    from nxdc.generation.sampling import SamplingParams
    from nxdc.runtime.threads import parse_threads
    from nxdc.runtime.workers import external_rank, follow, open_runner

    prompts = list(prompt or [])
    if not prompts:
        raise UserInputError("give at least one --prompt")
    if stream and len(prompts) > 1:
        raise UserInputError("--stream takes a single --prompt")
    if threads is not None:
        parse_threads(threads)
    sampling = SamplingParams(do_sample, temperature, top_k, top_p, seed).validate()
    if external_rank():  # a non-zero rank started by torchrun: compute only, rank 0 prints
        follow(export_dir, threads or 1)
        return
    if draft is not None and prompt_lookup is not None:
        raise UserInputError("--draft and --prompt-lookup are two ways to draft: pick one")
    if speculation_length is not None and draft is None and prompt_lookup is None:
        raise UserInputError("--speculation-length needs --draft or --prompt-lookup")
    runner = open_runner(export_dir, threads=threads)  # checks the manifest and versions first
    try:
        tokenizer = load_tokenizer(export_dir)
        speculator = _speculator(runner, tokenizer, draft, prompt_lookup, speculation_length, threads)
        _generate(
            runner,
            tokenizer,
            prompts,
            max_new_tokens,
            sampling,
            stop,
            chat,
            stream,
            json_out,
            quiet,
            speculator,
        )
    finally:
        runner.close()


def _speculator(runner, tokenizer, draft, prompt_lookup, k, threads):
    """The drafter the flags ask for (None: plain decoding)."""
    from nxdc.generation.speculative import DraftModel, PromptLookup, Speculator

    if draft is None and prompt_lookup is None:
        return None
    if draft is not None:
        from nxdc.runtime.runner import Runner

        if load_tokenizer(draft).get_vocab() != tokenizer.get_vocab():
            raise UserInputError(f"the draft {draft} has a different tokenizer from the target")
        drafter = DraftModel(Runner.load(draft, threads=threads), runner)
    else:
        drafter = PromptLookup(prompt_lookup)
    return Speculator(drafter, k or runner.speculation_length or 1, runner)


def _generate(
    runner, tokenizer, prompts, max_new_tokens, sampling, stop, chat, stream, json_out, quiet, speculator
):
    from nxdc.generation.loop import generate as run

    def on_text(t: str) -> None:
        sys.stdout.write(t)
        sys.stdout.flush()

    res = run(
        runner,
        tokenizer,
        prompts,
        max_new_tokens,
        sampling,
        list(stop or []),
        chat,
        on_text=on_text if stream and not json_out else None,
        speculator=speculator,
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
            f"decode {st['decode_tokens_per_s']:.1f} tok/s · {runner.threads} threads[/]"
        )
        full = sum(s.stop_reason == "max_seq" for s in res.sequences)
        if full:
            which = "" if len(res.sequences) == 1 else f" ({full} of {len(res.sequences)} prompts)"
            err_console.print(
                f"[yellow]note:[/] stopped at the export's sequence length, {runner.max_seq} tokens "
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
