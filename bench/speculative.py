"""Speculative decoding on SmolLM2: decode tok/s plain vs prompt lookup vs a truncated
self-draft, with acceptance rates (the table in docs/speculative.md).

    .venv/bin/python bench/speculative.py [--k 4] [--draft-layers 8] [--new-tokens 128] [--runs 3]

Exports (cached after the first run) go to bench/exports/spec-*. Greedy decoding throughout;
every speculative run is checked token for token against the plain run."""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

EXTRACTIVE = (
    "Here is a product description: The Aurora X2 is a lightweight carbon road bike with an "
    "11-speed Shimano 105 groupset, hydraulic disc brakes, 28 mm tubeless tyres and a frame "
    "weight of 890 grams. It comes in three sizes (52, 54 and 56 cm) and two colours, "
    "midnight blue and matte black. Repeat the product description word for word."
)
FREE = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--draft-layers", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()

    from transformers import AutoTokenizer

    from nxdc.generation.loop import generate
    from nxdc.generation.speculative import DraftModel, PromptLookup, Speculator
    from nxdc.pipeline import run_export
    from nxdc.plan import ExportOptions
    from nxdc.runtime.runner import Runner

    out = ROOT / "bench" / "exports"
    common = dict(sequence_length=512, context_buckets=(128,), decode_buckets=(512,))
    target_dir, draft_dir = out / "spec-target", out / f"spec-draft-l{args.draft_layers}"
    run_export("smollm2-135m", target_dir, ExportOptions(**common, speculation_length=args.k))
    run_export("smollm2-135m", draft_dir, ExportOptions(**common, num_layers=args.draft_layers))
    tok = AutoTokenizer.from_pretrained(target_dir)
    target = Runner.load(target_dir)
    draft = DraftModel(Runner.load(draft_dir), target)

    def run(prompt, drafter):
        rates, res = [], None
        for _ in range(args.runs + 1):  # the first run warms up
            spec = Speculator(drafter, args.k, target) if drafter else None
            res = generate(target, tok, [prompt], args.new_tokens, chat=True, eos_ids=set(), speculator=spec)
            rates.append(res.decode_tokens_per_s)
        return statistics.median(rates[1:]), res

    print(
        f"SmolLM2-135M fp32, k={args.k}, self-draft = first {args.draft_layers} of 30 layers, "
        f"{args.new_tokens} new tokens, greedy, median of {args.runs}"
    )
    print("| prompt | drafter | decode tok/s | × plain | acceptance | tokens per target call |")
    print("|---|---|---|---|---|---|")
    for label, prompt in (("extractive", EXTRACTIVE), ("free generation", FREE)):
        base, plain = run(prompt, None)
        print(f"| {label} | none (plain) | {base:.1f} | 1.00× | – | 1.00 |")
        for name, drafter in (("prompt lookup (n=3)", PromptLookup(3)), ("self-draft", draft)):
            rate, res = run(prompt, drafter)
            assert res.sequences[0].token_ids == plain.sequences[0].token_ids, name
            st = res.speculation
            print(
                f"| {label} | {name} | {rate:.1f} | {rate / base:.2f}× | "
                f"{st['acceptance_rate']:.0%} | {st['tokens_per_call']:.2f} |"
            )


if __name__ == "__main__":
    main()
