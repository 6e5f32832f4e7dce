"""``nxdc export --check-accuracy``: how far a reduced-precision weight format (``--weights``)
and KV cache (``--kv-cache``) move the model from fp32, measured on a fixed English text.

Both models are built in this process from the source checkpoint through the exporter's own
weight path (``write_weights``: same sharding-free tp 1 tensors, same quantisation) and run
eagerly over the text, teacher-forced. Reported: top-1 agreement of the next-token
predictions, perplexity of each model on the text and their ratio, and the largest absolute
logit difference; where the decode graphs multiply int8-quantized activations
(``--decode-matmul int8``: int4 layers on CPUs with VNNI) the same again for those numerics
(``decode``). Needs the fp32 model in memory (fine for small models; a 8B model needs
~32 GiB)."""

from __future__ import annotations

import dataclasses
import math
import tempfile
from pathlib import Path

import torch

from nxdc.compile.trace import wants_kernels
from nxdc.model import weight_format
from nxdc.model.decoder import Decoder, kv_cache_names, tie_lm_head
from nxdc.model.dtypes import TORCH_DTYPES
from nxdc.model.layers import decode_matmuls
from nxdc.pipeline import gguf_weight_map, prepare, write_weights
from nxdc.plan import stored_kv_cache

EVAL_TEXT = (
    "The lighthouse stood at the end of a narrow spit of rock, and for most of the year the only "
    "visitors were gulls and the supply boat that came on the first Monday of every month. The "
    "keeper kept a log of everything: the weather at dawn and at dusk, the ships that passed, the "
    "hours the lamp burned and the oil it used. Over thirty years the logs filled a whole wall of "
    "shelves, and in them one could follow the slow change of the coast, the storms that moved the "
    "sandbanks, the winter the harbour froze, and the spring the fishing fleet did not come back. "
    "Engineers measure a machine in the same patient way. A compiler that turns a model into fast "
    "code must be checked against a reference at every step: the shapes of the tensors, the order "
    "of the operations, the rounding of each sum. Memory bandwidth sets the pace of decoding, "
    "because every weight is read once for every token, so storing weights in fewer bits makes "
    "each step faster, as long as the answers stay the same. To know that they do, we compare the "
    "predictions of the smaller format with those of the original, token by token, and we count "
    "how often the most likely next word agrees. Numbers such as 3.14159, dates such as 12 March "
    "1998 and names such as Ada Lovelace and Alan Turing are part of the test as well, since they "
    "are where small errors tend to show first."
)


def measure(model: str, opts, text: str = EVAL_TEXT, cache_root: Path | None = None) -> dict:
    """Top-1 agreement, perplexities and max logit error of ``opts.weights`` and
    ``opts.kv_cache`` vs fp32 weights and KV cache."""
    return measure_formats(model, opts, [opts.weights or "fp32"], text, cache_root)[0]


def measure_formats(
    model: str, opts, formats: list[str], text: str = EVAL_TEXT, cache_root: Path | None = None
) -> list[dict]:
    """``measure`` for several weight formats, each with the KV cache an export of it gets
    (``opts.kv_cache``, or by default ``stored_kv_cache``'s choice), against one fp32 reference
    run (fp32 weights and cache)."""

    kv = opts.kv_cache
    opts = dataclasses.replace(
        opts, tp=1, batch_size=1, speculation_length=0, weights=None, kv_cache=None, dtype="fp32"
    )
    src, _, spec, plan = prepare(model, opts, cache_root)
    ids = _tokens(src, text, plan.sequence_length)
    target = ids[0, 1:]
    nll = lambda lg: float(torch.nn.functional.cross_entropy(lg[:-1], target))  # noqa: E731
    out, ref = [], None
    with tempfile.TemporaryDirectory(prefix="nxdc-accuracy-") as tmp:
        for i, fmt in enumerate(["fp32", *formats]):
            w, wmap = _resolved(fmt, src, spec, plan)
            p = dataclasses.replace(
                plan, weights=w, weight_map=wmap, kv_cache=stored_kv_cache(kv, w, "fp32") if i else None
            )
            path = Path(tmp) / f"{i}-{fmt}.safetensors"
            write_weights(src, spec, p, 0, path)
            got, decode = _logits(spec, p, path, ids, decode_int8=bool(i) and p.decode_matmul == "int8")
            path.unlink()
            if ref is None:
                ref = got
                continue
            ppl_ref = math.exp(nll(ref))
            row = {"weights": fmt, "kv_cache": p.kv_format, "tokens": int(ids.shape[1])}
            row.update(_agreement(ref, got, ppl_ref, nll))
            if decode is not None and not torch.equal(decode, got):  # int8 activations at decode
                row["decode"] = _agreement(ref, decode, ppl_ref, nll)
            out.append(row)
    return out


def _agreement(ref: torch.Tensor, got: torch.Tensor, ppl_ref: float, nll) -> dict:
    ppl = math.exp(nll(got))
    return {
        "top1_agreement": float((ref.argmax(-1) == got.argmax(-1)).float().mean()),
        "perplexity_fp32": ppl_ref,
        "perplexity": ppl,
        "perplexity_ratio": ppl / ppl_ref,
        "max_abs_logit_error": float((ref - got).abs().max()),
    }


def _resolved(fmt: str, src, spec, plan) -> tuple[str | None, dict | None]:
    """A ``--weights`` value as the plan holds it: canonical name, and ``auto``'s module map."""
    if fmt == "fp32":
        return None, None
    if fmt == weight_format.AUTO:
        return (weight_format.GGUF, gguf_weight_map(src, spec, plan)) if src.kind == "gguf" else (None, None)
    return weight_format.from_user(fmt).name, None


def _tokens(src, text: str, limit: int) -> torch.Tensor:
    with tempfile.TemporaryDirectory() as d:
        src.save_tokenizer(Path(d))
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(d)
    ids = tok(text)["input_ids"][:limit]
    return torch.tensor([ids], dtype=torch.int64)


def _logits(
    spec, plan, path: Path, ids: torch.Tensor, decode_int8: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Every position's logits with exact products, and (``decode_int8``) with the decode
    graphs' int8 activations: their rows do not depend on each other, so the teacher-forced text
    at once gives each token's decode-step numerics."""
    from safetensors.torch import load_file

    model = Decoder(
        spec,
        1,
        plan.sequence_length,
        TORCH_DTYPES[plan.dtype],
        weights=plan.weights,
        weight_map=plan.weight_map,
        kv_dtype=TORCH_DTYPES[plan.kv_format],
        kernels=bool(wants_kernels(plan)),
    ).eval()
    state = load_file(str(path))
    if spec.tie_word_embeddings:
        tie_lm_head(state)
    result = model.load_state_dict(state, strict=False)
    kv = set(kv_cache_names(spec))
    bad = [k for k in result.missing_keys if k not in kv] + list(result.unexpected_keys)
    if bad:
        raise AssertionError(f"accuracy check: weights do not fit the model: {bad[:3]}")
    t = ids.shape[1]
    pos = torch.arange(t)
    mask = (pos.view(1, t) <= pos.view(t, 1)).view(1, 1, t, t)
    run = lambda: model(ids, pos.view(1, t), mask, None, None, every_position=True)[0].float()  # noqa: E731
    with torch.no_grad():
        exact = run()
        if not decode_int8:
            return exact, None
        with decode_matmuls():
            return exact, run()
