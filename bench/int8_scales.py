"""How wide int8's group-scale search should be (docs/weights.md): SmolLM2 with its linear
weights quantized to int8 g32 (``nxdc.model.quant.quantize_int8``, then dequantized: the exact
products' numerics) for several ``SCALE_STEPS`` ranges, against fp32. transformers runs both
models (it is the reference implementation; nxdc's own eager path is what
``nxdc.accuracy.measure_formats`` measures on the shorter fixed text).

Reported per range: the weights' relative squared error, and on Gaussian and Laplace weights
of the 8B shape's FFN width; mean next-token KL to fp32 and top-1 agreement over the Python
standard library's module docstrings, teacher-forced in chunks of 512 tokens (at most 12;
Python 3.11's give 8: 4096 tokens); and how many of 20 chat prompts keep fp32's first 32 greedy
tokens, with where the others part.

    .venv/bin/python bench/int8_scales.py [--widths 0,2h,16,24,32,48]

A width W searches ``t`` in 0, 1, ..., W (``max|w| / (127 - t)``); ``2h`` is 0, 0.5, ..., 2, the
search that 0..32 replaced. Prints a Markdown table."""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from nxdc.model import quant  # noqa: E402
from nxdc.weights.sources import embedded_path  # noqa: E402

MODULES = "re argparse logging unittest typing json email pickle decimal datetime functools inspect"
PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about compilers.",
    "List the planets of the solar system.",
    "Tell me a short story about a robot.",
    "Explain photosynthesis in two sentences.",
    "What is 17 times 23?",
    "Give me three tips for learning to cook.",
    "Who wrote Romeo and Juliet?",
    "Describe the water cycle.",
    "Translate 'good morning' into Spanish.",
    "Why is the sky blue?",
    "Write a limerick about a cat.",
    "What are the benefits of exercise?",
    "How does a refrigerator work?",
    "Suggest a name for a coffee shop.",
    "Summarize the plot of Cinderella.",
    "What is machine learning?",
    "How many legs does a spider have?",
    "Write a short poem about the sea.",
    "What should I pack for a beach trip?",
]


def steps_of(width: str) -> tuple:
    return (0.0, 0.5, 1.0, 1.5, 2.0) if width == "2h" else tuple(range(int(width) + 1))


def quantized(w: torch.Tensor, steps: tuple) -> torch.Tensor:
    saved, quant.SCALE_STEPS = quant.SCALE_STEPS, steps
    try:
        return quant.dequantize_int8(*quant.quantize_int8(w, 32))
    finally:
        quant.SCALE_STEPS = saved


def synthetic_error(steps: tuple) -> list[float]:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(2048, 14336, generator=g)
    torch.manual_seed(0)  # Laplace samples from the global generator
    lap = torch.distributions.Laplace(0.0, 1.0).sample((2048, 14336))
    return [float((quantized(x, steps) - x).square().sum() / x.square().sum()) for x in (w, lap)]


class Model:
    def __init__(self):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        p = embedded_path("smollm2-135m")
        self.model = AutoModelForCausalLM.from_pretrained(
            p.parent, gguf_file=p.name, dtype=torch.float32
        ).eval()
        self.tok = AutoTokenizer.from_pretrained(p.parent, gguf_file=p.name)
        self.fp32 = {n: w.detach().clone() for n, w in self.model.named_parameters() if w.dim() == 2}
        text = "\n\n".join(importlib.import_module(m).__doc__ or "" for m in MODULES.split())
        ids = self.tok(text, return_tensors="pt")["input_ids"][0]
        self.chunks = [ids[i : i + 512].unsqueeze(0) for i in range(0, min(len(ids) - 511, 512 * 12), 512)]
        chat = lambda p: self.tok.apply_chat_template(  # noqa: E731
            [{"role": "user", "content": p}], add_generation_prompt=True, return_tensors="pt"
        )
        self.prompts = [c if torch.is_tensor(c) else c["input_ids"] for c in map(chat, PROMPTS)]
        self.ref = self.run()

    def load(self, convert) -> float:
        """Weights ``convert(fp32)``; returns their mean relative squared error."""
        errs = []
        with torch.no_grad():
            for n, w in self.model.named_parameters():
                if n in self.fp32:
                    w.copy_(convert(self.fp32[n]))
                    errs.append(float((w - self.fp32[n]).square().sum() / self.fp32[n].square().sum()))
        return sum(errs) / len(errs)

    def run(self) -> tuple[list, list]:
        with torch.no_grad():
            logp = [self.model(c).logits[0].log_softmax(-1) for c in self.chunks]
            text = [
                self.model.generate(p, max_new_tokens=32, do_sample=False)[0, p.shape[1] :]
                for p in self.prompts
            ]
        return logp, [t.tolist() for t in text]

    def compare(self) -> dict:
        logp, text = self.run()
        pairs = list(zip(logp, self.ref[0], strict=True))
        kl = torch.cat(
            [torch.nn.functional.kl_div(a, b, log_target=True, reduction="none").sum(-1) for a, b in pairs]
        )
        top1 = torch.cat([(a.argmax(-1) == b.argmax(-1)).float() for a, b in pairs])
        # a text that stops at EOS ends on it, so the shorter one's length is enough to compare
        parts = [
            next((j for j, (a, b) in enumerate(zip(x, y, strict=False)) if a != b), 32)
            for x, y in zip(text, self.ref[1], strict=True)
        ]
        return {"kl": float(kl.mean()), "top1": float(top1.mean()), "tokens": len(top1), "parts": parts}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--widths", default="0,2h,16,24,32,48", help="t ranges 0..W; 2h: 0, 0.5, ..., 2")
    args = ap.parse_args()
    m = Model()
    print(
        "| search `t` | rel. sq. error: SmolLM2 / Gaussian / Laplace | KL to fp32 | top-1 "
        "| greedy 32 identical (of 20) | where the others part |"
    )
    print("|---|---|---|---|---|---|")
    for width in args.widths.split(","):
        steps = steps_of(width)
        err = m.load(lambda w, s=steps: quantized(w, s))
        r, (g, lap) = m.compare(), synthetic_error(steps)
        same = sum(p == 32 for p in r["parts"])
        print(
            f"| 0..{width} | {err:.3e} / {g:.3e} / {lap:.3e} | {r['kl']:.5f} | {r['top1']:.2%} "
            f"of {r['tokens']} | {same} | {[p for p in r['parts'] if p < 32]} |",
            flush=True,
        )
    m.load(lambda w: w.to(torch.bfloat16).float())
    r = m.compare()
    print(
        f"| bf16 weights | | {r['kl']:.5f} | {r['top1']:.2%} | {sum(p == 32 for p in r['parts'])} "
        f"| {[p for p in r['parts'] if p < 32]} |"
    )


if __name__ == "__main__":
    main()
