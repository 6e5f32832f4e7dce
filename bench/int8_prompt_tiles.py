"""What putting ``--weights int8`` prompts on bf16 tiles costs in accuracy (docs/weights.md,
``--prefill-matmul tiles-int8``): SmolLM2 int8 g32 against fp32.

1. Teacher-forced, eager (nxdc's own int8 model, ``nxdc.accuracy.measure_formats``), over the
   Python standard library's module docstrings (2048 tokens): the int8 layers' products computed
   from the dequantised weights as they are (exact), with the activations rounded to bf16, the
   weights rounded to bf16, both (one-part tiles), or the weights rounded and the activations in
   two bf16 parts (``tiles-int8``). Top-1 agreement, perplexity ratio, mean next-token KL to fp32.
2. Compiled: greedy 32 tokens on bench/int8_scales.py's 20 chat prompts from an int8 export with
   ``--prefill-matmul exact`` and one with ``tiles-int8``, against transformers' fp32 greedy.

    .venv/bin/python bench/int8_prompt_tiles.py [--work DIR]   # exports into DIR (default a temp dir)
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from nxdc import accuracy  # noqa: E402
from nxdc.model import layers  # noqa: E402
from nxdc.plan import ExportOptions  # noqa: E402

VARIANTS = ("exact", "x-bf16", "w-bf16", "both-bf16", "two-part")


def _bench_module(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _text() -> str:
    mods = _bench_module("int8_scales").MODULES.split()
    return "\n\n".join(importlib.import_module(m).__doc__ or "" for m in mods)


def _emulated(variant: str):
    """Linear.forward whose int8 layers (16 rows and more) multiply as ``variant`` says."""
    exact = layers.Linear.forward

    def forward(self, x):
        if variant == "exact" or self.fmt is None or not self.fmt.quantized or x.shape[-2] < 16:
            return exact(self, x)
        w = self._dequantized(torch.float32)
        w = w if variant == "x-bf16" else w.bfloat16().float()
        xf = x.float()
        if variant in ("x-bf16", "both-bf16"):
            y = F.linear(xf.bfloat16().float(), w)
        elif variant == "two-part":
            hi = xf.bfloat16().float()
            y = F.linear(hi, w) + F.linear((xf - hi).bfloat16().float(), w)
        else:
            y = F.linear(xf, w)
        y = y.to(x.dtype)
        return y + self.bias if self.bias is not None else y

    return forward


def teacher_forced(text: str) -> list[tuple]:
    rows, kept = [], {}
    logits = accuracy._logits

    def keep(spec, plan, path, ids, decode_int8=False):
        out = logits(spec, plan, path, ids, decode_int8)
        kept[plan.weights] = out[0]
        return out

    accuracy._logits = keep
    forward = layers.Linear.forward
    try:
        for v in VARIANTS:
            layers.Linear.forward = _emulated(v)
            r = accuracy.measure_formats("smollm2-135m", ExportOptions(sequence_length=2048), ["int8"], text)[
                0
            ]
            ref, got = kept.pop(None), kept.popitem()[1]  # fp32's, then int8's
            kl = F.kl_div(got.log_softmax(-1), ref.log_softmax(-1), log_target=True, reduction="batchmean")
            rows.append((v, r["tokens"], r["top1_agreement"], r["perplexity_ratio"], float(kl)))
    finally:
        layers.Linear.forward, accuracy._logits = forward, logits
    return rows


def greedy(work: Path) -> dict[str, int]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from nxdc.generation.loop import encode_prompts, generate
    from nxdc.pipeline import run_export
    from nxdc.runtime.runner import Runner
    from nxdc.weights.sources import embedded_path

    prompts = _bench_module("int8_scales").PROMPTS
    outs = {}
    for mode in ("exact", "tiles-int8"):
        out = work / f"smollm2-int8-{mode}"
        if not (out / "nxdc.json").exists():
            opts = ExportOptions(
                batch_size=1, sequence_length=128, context_buckets=(64,), weights="int8", prefill_matmul=mode
            )
            run_export("smollm2-135m", out, opts)
        outs[mode] = out
    p = embedded_path("smollm2-135m")
    hf = AutoModelForCausalLM.from_pretrained(
        str(p.parent), gguf_file=p.name, torch_dtype=torch.float32
    ).eval()
    tok = AutoTokenizer.from_pretrained(outs["exact"])
    ref = []
    for q in prompts:
        ids = torch.tensor([encode_prompts(tok, [q], chat=True)[0]])
        with torch.no_grad():
            out = hf.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=32,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=2,
            )
        ref.append(out[0, ids.shape[1] :].tolist())
    counts = {}
    for mode, out in outs.items():
        s = Runner.load(out)
        got = [
            generate(s, tok, [q], max_new_tokens=32, chat=True, eos_ids=set()).sequences[0].token_ids
            for q in prompts
        ]
        counts[mode] = sum(a == b for a, b in zip(got, ref, strict=True))
    return counts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", type=Path, help="where the two int8 exports go (kept for reruns)")
    args = ap.parse_args()
    print("| int8 layers' products | tokens | top-1 vs fp32 | perplexity ratio | KL to fp32 |")
    print("|---|---|---|---|---|")
    for v, n, top1, ppl, kl in teacher_forced(_text()):
        print(f"| {v} | {n} | {top1:.2%} | {ppl:.4f} | {kl:.5f} |")
    with tempfile.TemporaryDirectory(prefix="nxdc-int8-tiles-") as tmp:
        counts = greedy(args.work or Path(tmp))
    for mode, n in counts.items():
        print(f"greedy 32 tokens equal to transformers fp32's, --prefill-matmul {mode}: {n} of 20 prompts")


if __name__ == "__main__":
    main()
